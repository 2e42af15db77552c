"""The names a server answers to: `--alias` / `--served-model-name`, else the model file's name.

As llama-server does, a request that names another model is answered by the one model the server
runs; `--strict-model-name` refuses it instead (404), as vLLM and the OpenAI API do. A path is
never one of the names (accepting it would confirm where the file lives)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelNames:
    aliases: tuple[str, ...] = ()
    strict: bool = False

    def served(self, model_path: str | Path) -> tuple[str, ...]:
        """The names /v1/models lists, the first one in every answer."""
        return self.aliases or (Path(model_path).name,)

    def accepts(self, name: str | None, model_path: str | Path) -> bool:
        path = Path(model_path)
        return not name or not self.strict or name in {*self.served(path), path.name, path.stem}

    @classmethod
    def of(cls, aliases: Sequence[str] | None, strict: bool) -> ModelNames:
        return cls(tuple(dict.fromkeys(a for a in aliases or () if a)), strict)


ANY_NAME = ModelNames()  # the default: the file's name, and requests naming any model answered
