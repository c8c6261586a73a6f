"""Building the native backend for a loaded target: its `NativeModel`, shared per precision
and device, over a fresh cache pool, as the `native` registration (backends/native/__init__.py)
asks; the options it takes, and a teacher-forced check of the precisions against fp32."""

from __future__ import annotations

import weakref

import torch

from specdec.backends.native.kernels.cpu import forced_fallback
from specdec.backends.native.kernels.precisions import LM_HEADS
from specdec.backends.native.model.native_model import GGUF_PRECISION, NativeModel
from specdec.backends.native.model.sequence import NativeSequence
from specdec.errors import SpecdecError

NATIVE_OPTIONS = ("precision", "device", "max_length", "slots", "compile", "lm_head", "kv_dtype")


# KV-cache element types (the kv_dtype option; the default: NativeModel.default_kv_dtype).
# bf16 and fp16 halve the cache. The numba attention kernel reads fp32 and bf16
# (numba_ops.usable); fp16 runs the PyTorch routine of attention.py, batch-invariant as well.
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# a GGUF target (LoadedModel) or an HF model -> {(precision, device, ...): model}
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def native_model_for(target, precision: str | None = None, device=None, compile: bool = False,
                     lm_head: str = "auto") -> NativeModel:
    """The NativeModel of a LoadedModel, built once per (precision, device) and shared: a GGUF
    target's from its file as it is (no transformers model), any other's over the transformers
    model's tensors (no copy for fp32 on its device). `precision` None: default_precision."""
    device = torch.device(device) if device is not None else target.device
    precision = precision or default_precision(device, target.gguf_path is not None)
    if precision == GGUF_PRECISION and target.gguf_path is None:
        raise SpecdecError(f"precision {GGUF_PRECISION} reads GGUF files; {target.name!r} is not one",
                           "precision")
    owner = target if target.gguf_path is not None else target.model
    models = _SHARED.setdefault(owner, {})
    key = (precision, str(device), bool(compile), lm_head, forced_fallback())
    if key not in models:
        if target.gguf_path is not None:
            models[key] = NativeModel.from_gguf(target.gguf_path, precision, device, lm_head)
        else:
            models[key] = NativeModel.from_hf(target.model, precision, device, lm_head)
    return models[key]


# A held-out paragraph for precision checks (written for this project, so no model trained on it).
HELDOUT_TEXT = (
    "The harbour office opened at seven, but the ferry captains had been arguing since dawn about "
    "whether the fog would lift before the first crossing. Marta, who kept the tide tables, pinned a "
    "new chart to the board and circled the hour when the current would turn. Nobody read it. They "
    "were too busy comparing the weather radio with the color of the sky over the lighthouse, a "
    "method that had been wrong often enough to be trusted. By eight the fog had thinned to a pale "
    "veil, the gulls returned to the pier, and the first boat left twelve minutes late with three "
    "passengers, a crate of oranges and a bicycle that belonged to no one in particular."
)


def compare_precisions(target, text: str = HELDOUT_TEXT, precisions=("bf16", "int8", "int4")) -> dict:
    """Teacher-forced check of each native precision against native fp32 on `text`:
    perplexity, top-1 agreement with fp32 and mean KL(fp32 || precision) per token."""
    ids = target.tokenizer.encode(text)

    def logprobs(precision: str) -> torch.Tensor:  # [T-1, V]
        seq = native_model_for(target, precision).new_pool(max_length=len(ids)).new_sequence()
        # short chunks: the precision's own layers (prompt-length forwards may run dense fp32)
        logits = torch.cat([seq.forward(ids[i : i + 32]) for i in range(0, len(ids), 32)])
        return torch.log_softmax(logits[:-1].double(), dim=-1)

    reference = logprobs("fp32")
    nexts = torch.tensor(ids[1:])
    report = {"tokens": len(ids) - 1}
    for precision in ("fp32", *precisions):
        lp = reference if precision == "fp32" else logprobs(precision)
        report[precision] = {
            "perplexity": float(torch.exp(-lp.gather(1, nexts[:, None]).mean())),
            "top1_agreement": float((lp.argmax(-1) == reference.argmax(-1)).double().mean()),
            "kl": float((reference.exp() * (reference - lp)).sum(-1).mean()),
        }
    return report


def check_device(device) -> torch.device:
    """A torch.device that exists on this machine, or a one-line SpecdecError."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SpecdecError(f"unknown device {str(device)!r}: {str(e).splitlines()[0]}", "device") from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", lambda: False)()
        count = getattr(module, "device_count", lambda: 1)() if available else 0
        if not available or (device.index or 0) >= count:
            raise SpecdecError(f"device {str(device)!r} is not available on this machine", "device")
    return device


def default_precision(device=None, gguf: bool = False) -> str:
    """On a cpu: a GGUF's own types ("gguf") for a GGUF, else int4; bf16 elsewhere. On a cpu
    int4 decodes fastest of the precisions (fbgemm's fp16 GEMM uses one thread), and both
    compute each row on its own, so a token's logits do not depend on how many tokens a
    forward scores and speculation reproduces plain greedy decoding bit for bit."""
    if torch.device(device or "cpu").type != "cpu":
        return "bf16"
    return GGUF_PRECISION if gguf else "int4"


def make_native_backend(target, prefix_cache: str = "prompt", precision: str | None = None, device=None,
                        max_length: int | None = None, slots: int = 1, compile: bool = False,
                        lm_head: str = "auto", kv_dtype: str | None = None) -> NativeSequence:
    """A sequence over a fresh pool (its own KV cache) for a LoadedModel's weights: a GGUF's read
    from its file, others' from the transformers model. The cache holds `max_length` tokens
    (default: the model's window) of `kv_dtype` (KV_DTYPES; default: the model's
    default_kv_dtype), committed as they are held."""
    device = check_device(device if device is not None else target.device)
    if lm_head not in LM_HEADS:
        raise SpecdecError(f"unknown lm_head {lm_head!r}; choose one of: {', '.join(LM_HEADS)}", "lm_head")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise SpecdecError(f"unknown kv_dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPES)}",
                           "kv_dtype")
    try:
        model = native_model_for(target, precision, device, _flag(compile), lm_head)
    except ValueError as e:  # lm_head ort8 where it cannot run
        raise SpecdecError(str(e), "lm_head") from None
    length = int(max_length) if max_length else None
    pool = model.new_pool(int(slots), length, KV_DTYPES.get(kv_dtype), prefix_cache=prefix_cache)
    if _flag(compile) and not model.compiled:
        model.compile(pool)  # traced on this pool's cache shapes; the seconds are in compile_seconds
    return pool.new_sequence()


def _flag(value) -> bool:  # options may arrive as strings from drafter specs or the CLI
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
