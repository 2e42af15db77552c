"""The instruction-set switch as users reach it (POWERINFER_ISA, set per process): each path this CPU
runs writes the scalar path's greedy text, and the switch only ever lowers the CPU's best."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from powerinfer.ops import native

from helpers import powerinfer

pytestmark = pytest.mark.skipif(native.load() is None, reason="native operators unavailable")
# a prompt whose greedy continuation the model is sure of: paths whose logits differ in the last
# bits write the same text, a wrong kernel does not
PROMPT = "1, 2, 3, 4, 5, 6,"  # the scalar path leads by >= 3.5 logits at each of the 8 tokens


def active_isa(wanted: str) -> str:
    code = "from powerinfer.ops import native; print(native.load().isa())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "POWERINFER_ISA": wanted})
    return result.stdout.strip()


def greedy_text(model, isa: str) -> str:
    os.environ["POWERINFER_ISA"] = isa
    try:
        result = powerinfer("run", "-m", str(model), "-p", PROMPT, "-n", "8", "--temp", "0", "-t", "2")
    finally:
        del os.environ["POWERINFER_ISA"]
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_switch_lowers_and_never_raises():
    best = native.load().detected_isa()
    assert active_isa("scalar") == "scalar"
    assert active_isa("avx512") == ("avx512" if best == "avx512" else best)  # a set the CPU lacks: its best
    assert active_isa("avx1024") == best
    if best != "scalar":
        assert active_isa("avx2") == "avx2"


def test_avx_vnni_is_on_where_the_cpu_has_it_unless_the_environment_says_0():
    def used(setting: str) -> str:
        code = "from powerinfer.ops import native; print(native.load().avx_vnni())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "POWERINFER_AVX_VNNI": setting}).stdout.strip()

    has = native.load().avx_vnni_detected()
    assert used("1") == str(has)
    for off in ("0", "off", "False"):
        assert used(off) == "False"
    if not has:
        with pytest.raises(ValueError, match="AVX-VNNI"):
            native.load().set_avx_vnni(True)


def test_quantlinear_runs_the_bfloat16_kernel_by_default_on_amd_only_unless_the_environment_says():
    def used(setting: str | None) -> str:
        code = "from powerinfer.ops import native; print(native.load().bf16_dot(), native.load().quant_kernel_isa())"
        env = {key: value for key, value in os.environ.items() if key != "POWERINFER_BF16_DOT"}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**env, **({"POWERINFER_BF16_DOT": setting} if setting else {})}).stdout.strip()

    best = native.load().detected_isa()
    if best == "avx512":  # an x86 CPU: /proc/cpuinfo names its vendor
        vendor = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("vendor_id"))
        assert used(None) == ("True avx512" if vendor == "AuthenticAMD" else "False avx2")
        assert used("1") == "True avx512" and used("off") == "False avx2"
    else:
        assert used("1") == f"False {best}"  # no AVX-512: nothing to switch
        with pytest.raises(ValueError, match="AVX-512"):
            native.load().set_bf16_dot(True)


@pytest.fixture(scope="module")
def scalar_text(default_model) -> str:
    return greedy_text(default_model, "scalar")


@pytest.mark.slow
@pytest.mark.parametrize("isa", [isa for isa in native.instruction_sets() if isa != "scalar"] if native.load() else [])
def test_each_instruction_set_writes_the_scalar_paths_greedy_text(default_model, scalar_text, isa):
    """AVX2 rounds x to int8 and AVX-512 and the scalar path to bfloat16 (quant_matmul.h): the logits
    differ a little, the greedy text where the model is sure does not."""
    assert greedy_text(default_model, isa) == scalar_text


@pytest.mark.slow
def test_each_instruction_set_picks_the_scalar_paths_token_where_the_model_is_sure(default_llm):
    """Over real text, switched in this process: wherever the scalar path's best token leads the
    next by more than one logit, every other path picks it too, and the distributions stay close."""
    text = (Path(__file__).parent / "data" / "wikitext-2" / "valid.txt").read_text()[:2000]
    ids = default_llm.tokenize(text)[:160]
    logits = {}
    for isa in native.instruction_sets():
        with native.instruction_set(isa):
            logits[isa] = torch.as_tensor(default_llm.logits(ids))
    reference = logits.pop("scalar")
    top2 = reference.topk(2, dim=-1).values
    sure = top2[:, 0] - top2[:, 1] > 1.0
    assert sure.sum() > 40
    log_p = torch.log_softmax(reference, -1)
    for isa, got in logits.items():
        assert torch.equal(got.argmax(-1)[sure], reference.argmax(-1)[sure]), isa
        kl = (log_p.exp() * (log_p - torch.log_softmax(got, -1))).sum(-1).mean()
        assert kl < 0.05, (isa, kl)


def instructions_by_function() -> dict[str, list[str]]:
    """The compiled module's disassembly: function name -> its instructions."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", native.load().__file__],
                             capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        if line.endswith(">:") and " <" in line:
            current = functions.setdefault(line.split(" <", 1)[1][:-2], [])
        elif line.startswith(" ") and "\t" in line:
            current.append(line.split("\t", 1)[1])
    return functions


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_a_build_runs_on_any_x86_64_cpu():
    """What keeps a wheel built on an AVX-512 machine from dying of SIGILL on an AVX2-only one (and
    both on a CPU without AVX): VEX/EVEX instructions only in the kernels of an instruction set's
    namespace, 512-bit registers and mask registers only in AVX-512's."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    for function, instructions in instructions_by_function().items():
        vex = [i for i in instructions if i.startswith("v")]
        if vex:
            assert "powerinfer::avx2::" in function or "powerinfer::avx512::" in function, (function, vex[:3])
        if any("%zmm" in i or re.search(r"%k[1-7]\b", i) for i in instructions):
            assert "powerinfer::avx512::" in function, function
