"""Errors a user can act on.

Every failure caused by the user's input (a file, a flag, a request) is raised as a
`PowerInferError` whose message is one line that says what is wrong; the CLI prints it and exits
with status 2, the server turns it into a 4xx answer. Anything else is a bug and keeps its traceback.
"""


class PowerInferError(Exception):
    """A problem with the user's input, reported as one line."""


class ModelFileError(PowerInferError):
    """A model file that is missing, truncated, corrupt or not a GGUF."""


class UnsupportedModelError(PowerInferError):
    """A well-formed model that uses an architecture or tensor type we do not run."""


class ChatTemplateError(PowerInferError):
    """A chat template that fails to parse or render, or exceeds its budget (`chat_template.RenderBudget`)."""


class ContextOverflowError(PowerInferError):
    """A prompt (plus the tokens asked for) that does not fit in the context window."""
