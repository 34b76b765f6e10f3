"""Records a training run at the loss: every call's per-sequence numbers, with their bits, keyed by the sequence.

    rec = TrainingRecorder("runs/my-run", rank=dp_rank)       # GRPOCoreTrainer(..., record_dir=...) does this
    result = linear_grpo_loss(hidden, weight, completion_ids, old_logps, None, mask, advantages=adv, ...)
    rec.record(result, step=step, input=hidden, completion_ids=completion_ids, completion_mask=mask,
               prompt_ids=prompt_ids, prompt_mask=prompt_mask, old_logps=old_logps, micro_batch=i)
    result.loss.backward()                                   # the gradient of `input` is digested in its hook
    rec.close()                                              # or: the next step's first record hands it off

Each optimizer step of each rank becomes one Parquet file, `rank-<R>/step-<S>.parquet` (written whole, then renamed
into place: a run can be read while it goes on). One row per (step, sequence, field): the value and its exact bit
pattern, or a digest. A sequence is found by its key, a hash of its prompt's and completion's active token ids, not by
where it sat, so two runs with other ranks, micro-batches or accumulation are compared sequence by sequence
(`python -m harness diff`, `python -m reports drift`).

Per sequence: the result's `per_sequence_policy`, `per_sequence_kl`, `advantages` (sequence-level ones),
`per_sequence_active_tokens` and `per_sequence_entropy` (when computed), and four digests:
- `input_digest`: the active rows of the loss's differentiable input (the hidden states of the fused linear loss, the
  logits of the logits ops), their bits;
- `logps_digest`: the given old and reference log-probs, importance-sampling ratio and token-level advantages at
  the active tokens (absent when none is given);
- `grad_digest`: the active rows of that input's gradient, taken in a hook during the backward (absent when no
  backward ran), and `grad_mantissa_digest`: their bits less the exponents (unmoved by a power-of-two scale).
Per call, the scalars `loss`, `policy_loss` and `kl` under the sequence `rank<R>/micro-batch<M>`.

A digest is `grpo_core.digest.row_digests`: exact integer arithmetic on the bit patterns, the same bits give the same
digest on every device; it is computed where the tensor lives (one read of it; a call's digests in one matmul). A
step's numbers and token ids leave the device in one copy queued without a host synchronization when the next step
begins (or the trainer's step ends), and a background thread writes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .contract import MATH_VERSION
from .digest import RowDigests, mantissas
from .result import GRPOLossResult

__all__ = ["TrainingRecorder", "sequence_keys"]

SEQUENCE_FIELDS = ("per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens",
                   "per_sequence_entropy")
DIGEST_FIELDS = ("input_digest", "logps_digest", "grad_digest", "grad_mantissa_digest")
SCALAR_FIELDS = ("loss", "policy_loss", "kl")
KEY_FORMAT = "blake2b-64(int64le: prompt length, prompt ids, completion ids)"  # in every file: runs of one format match


def _hex(digests: torch.Tensor) -> list[str]:
    """Each row's lanes (each below 2**31) as 8 hex digits apiece."""
    flat = digests.numpy().astype(">u4").tobytes().hex()
    width = 8 * digests.shape[1]
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def sequence_keys(completion_ids: torch.Tensor, completion_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None,
                  prompt_mask: torch.Tensor | None = None) -> list[str]:
    """One key per sequence: 16 hex digits of a BLAKE2b hash of its prompt's active token count (8 bytes), its
    prompt's active token ids and its completion's active token ids (int64 little-endian; padding never enters)."""
    def active(ids: torch.Tensor | None, mask: torch.Tensor | None) -> list[np.ndarray]:
        if ids is None:
            return [np.zeros(0, "<i8")] * completion_ids.shape[0]
        ids = ids.detach().cpu().numpy().astype("<i8")
        return list(ids) if mask is None else [row[k] for row, k in zip(ids, mask.detach().cpu().bool().numpy())]

    return [hashlib.blake2b(np.int64(len(p)).astype("<i8").tobytes() + p.tobytes() + c.tobytes(),
                            digest_size=8).hexdigest()
            for p, c in zip(active(prompt_ids, prompt_mask), active(completion_ids, completion_mask))]


def _provenance(device: torch.device) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "machine": platform.machine(), "math_version": MATH_VERSION,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            "device_type": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "tf32": torch.backends.cuda.matmul.allow_tf32,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


class _HostCopy:
    """Tensors copied to the host: those on `device` in one transfer (a CUDA device's into pinned memory, queued
    without a host synchronization; `tensors()` waits for it), any other one copied alone."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.specs = [(t.dtype, t.shape) for t in tensors]
        self.here = sorted((i for i, t in enumerate(tensors) if t.device == device),
                           key=lambda i: -tensors[i].element_size())  # the widest first: every piece stays aligned
        self.elsewhere = {i: t.detach().to("cpu", copy=True) for i, t in enumerate(tensors) if t.device != device}
        flat = torch.cat([tensors[i].detach().reshape(-1).view(torch.uint8) for i in self.here] or
                         [torch.empty(0, dtype=torch.uint8, device=device)])  # a copy: later writes do not reach it
        self.ready = None
        if device.type == "cuda":
            self.flat = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            self.flat.copy_(flat, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(device))  # the copy's stream: the source device's
        else:
            self.flat = flat.cpu()

    def tensors(self) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        out, offset = dict(self.elsewhere), 0
        for i in self.here:
            dtype, shape = self.specs[i]
            size = shape.numel() * dtype.itemsize
            out[i] = self.flat[offset:offset + size].view(dtype).view(shape)
            offset += size
        return [out[i] for i in range(len(self.specs))]


def _leaves(x: Any) -> list[torch.Tensor]:
    """The tensors of a nest of tuples, lists and dicts, in order (None holds none)."""
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return [t for v in items for t in _leaves(v)]


def _rebuild(x: Any, tensors: Any) -> Any:
    """`x` with its tensors replaced, in order, by the next ones of the iterator `tensors`."""
    if isinstance(x, torch.Tensor):
        return next(tensors)
    if isinstance(x, dict):
        return {k: _rebuild(v, tensors) for k, v in x.items()}
    return type(x)(_rebuild(v, tensors) for v in x) if isinstance(x, (tuple, list)) else x


class TrainingRecorder:
    """Appends every loss call of a training run to `record_dir` (see the module docstring). `rank`: this process's
    data-parallel rank (with tensor parallelism, record on TP rank 0 alone: its peers hold the same numbers);
    `metadata`: what describes the run (world size, accumulation, ...), stored with provenance in every file."""

    def __init__(self, record_dir: str | os.PathLike, *, rank: int = 0, metadata: dict[str, Any] | None = None):
        _check_count("rank", rank)
        self.dir = Path(record_dir) / f"rank-{rank:05d}"
        if self.dir.exists() and any(self.dir.glob("step-*.parquet")):
            raise ValueError(f"record_dir: expected a new folder or one without rank {rank}'s steps (a recorded run is "
                             f"never replaced), got {record_dir}, which holds {self.dir}")
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata: expected values that JSON can write (it is stored in every file), got "
                             f"{metadata!r} ({exc})") from None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.metadata = rank, dict(metadata or {})
        self._step: int | None = None
        self._written: int | None = None  # the last step written: never written again
        self._calls: list[dict[str, Any]] = []
        self._provenance: dict[str, Any] | None = None
        self._device = torch.device("cpu")  # where the recorded tensors live: the first call's input's device
        # one background thread writes the steps handed off (it ends with the recorder; a pending write ends first)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-core-recorder")
        self._writing: Future | None = None  # the write of the last step handed off

    def record(self, result: GRPOLossResult, *, step: int, input: torch.Tensor, completion_ids: torch.Tensor,
               completion_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None,
               prompt_mask: torch.Tensor | None = None, old_logps: torch.Tensor | None = None,
               ref_logps: torch.Tensor | None = None, importance_sampling_ratio: torch.Tensor | None = None,
               micro_batch: int = 0, generation: int = 0, sequences: tuple[int, int] | None = None) -> None:
        """Records one loss call. `input` `[B, T, ...]`: the tensor the loss was called with (hidden states or logits),
        its gradient digested in a hook when a backward runs; `completion_ids` / `completion_mask` `[B, T]`: the
        completion (the mask: the loss's active tokens); `prompt_ids` / `prompt_mask`: the prompt (part of the key).
        `sequences`: `(lo, hi)`, where this rank's B sequences sit in the result's vectors (default: the result covers
        exactly these B sequences, as a call in one process does)."""
        for name, value in (("step", step), ("micro_batch", micro_batch), ("generation", generation)):
            _check_count(name, value)
        if self._step is not None and step < self._step:
            raise ValueError(f"step: expected at least the last recorded step {self._step}, got {step}")
        if step == self._written:
            raise ValueError(f"step: expected more than {step}, the last written step, got {step} (a written step is "
                             f"never replaced)")
        if completion_mask.dim() != 2:
            raise ValueError(f"completion_mask: expected [B, T], got {list(completion_mask.shape)}")
        mask = completion_mask.bool()
        B, T = mask.shape
        for name, t, shape, dims in (("completion_ids", completion_ids, "[B, T]", 2),
                                     ("input", input, "[B, T, ...]", 2), ("prompt_ids", prompt_ids, "[B, P]", 1)):
            if t is not None and (t.dim() < 2 or t.shape[:dims] != mask.shape[:dims]):
                like = f"[B, T] = {[B, T]}" if dims == 2 else f"B = {B}"
                raise ValueError(f"{name}: expected {shape} with {like} like completion_mask, got {list(t.shape)}")
            if name != "input" and t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"{name}: expected integer token ids, got {t.dtype}")
        if prompt_mask is not None and (prompt_ids is None or prompt_mask.shape != prompt_ids.shape):
            raise ValueError(f"prompt_mask: expected the shape of prompt_ids, "
                             f"{None if prompt_ids is None else list(prompt_ids.shape)}, got {list(prompt_mask.shape)}")
        for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps),
                        ("importance_sampling_ratio", importance_sampling_ratio)):
            ok = [[B, T], [B, 1]] if name == "importance_sampling_ratio" else [[B, T]]
            if t is not None and list(t.shape) not in ok:
                raise ValueError(f"{name}: expected [B, T] = {[B, T]}{' or [B, 1]' if len(ok) > 1 else ''} like "
                                 f"completion_mask, got {list(t.shape)}")
        n = result.per_sequence_policy.shape[0]
        lo, hi = (0, n) if sequences is None else sequences
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo <= hi <= n \
                or hi - lo != B:
            raise ValueError(f"sequences: expected (lo, hi) with hi - lo = {B} sequences of completion_ids and "
                             f"0 <= lo <= hi <= {n} (the result's sequences), got {sequences!r}")
        if step != self._step:
            self.flush(wait=False)
            self._step = step
        rows = RowDigests(mask, input.device)
        token_advantages = result.advantages[lo:hi] if result.advantages.dim() == 2 else None
        given = [t.detach().float().expand(B, T) for t in
                 (old_logps, ref_logps, importance_sampling_ratio, token_advantages) if t is not None]
        digests = rows(input, torch.stack(given, -1)) if given else [rows(input)[0], None]  # one matmul
        call: dict[str, Any] = {
            "micro_batch": micro_batch, "generation": generation,
            "keys": (completion_ids.detach(), mask, None if prompt_ids is None else prompt_ids.detach(),
                     None if prompt_mask is None else prompt_mask.detach()),
            "scalars": torch.stack([result.loss.detach(), result.policy_loss, result.kl]).float(),
            "vectors": {f: getattr(result, f)[lo:hi].detach() for f in SEQUENCE_FIELDS
                        if getattr(result, f) is not None and (f != "advantages" or getattr(result, f).dim() == 1)},
            "input_digest": digests[0], "logps_digest": digests[1]}
        if self._provenance is None:
            self._device, self._provenance = input.device, _provenance(input.device)
        if input.requires_grad and torch.is_grad_enabled():
            def hook(grad: torch.Tensor) -> None:
                call["grad_digest"], call["grad_mantissa_digest"] = rows(grad, mantissas(grad))
                handle.remove()  # this call's backward only: an input used again gets its next call's hook

            handle = input.register_hook(hook)
        self._calls.append(call)

    def flush(self, *, wait: bool = True) -> Path | None:
        """Writes the calls of the current step to its file (nothing when there is none); returns the file.
        `wait=False` (the trainer's and a new step's first `record`'s): the step's numbers leave the device in one copy
        without a host synchronization and a background thread writes the file; the next `flush` or `close` waits for
        it and raises its error (the step is not written again). With `wait=True` a failed write leaves the step to be
        flushed again."""
        self._join()
        if not self._calls:
            return None
        path = self.dir / f"step-{self._step:07d}.parquet"
        if path.exists():
            raise ValueError(f"record_dir: expected no other recorder of rank {self.rank} in {self.dir.parent} (a "
                             f"recorded step is never replaced), got {path}, written by another one")
        calls, step = self._calls, self._step
        parts = [(c["keys"], c["scalars"], c["vectors"], [c.get(f) for f in DIGEST_FIELDS]) for c in calls]
        host = _HostCopy(_leaves(parts), self._device)
        meta = {"kind": "training", "rank": self.rank, "metadata": self.metadata, "provenance": self._provenance,
                "grpo_core_version": _version(), "sequence_keys": KEY_FORMAT}
        args = (path, step, [(c["micro_batch"], c["generation"]) for c in calls], parts, host, meta)
        if wait:
            self._write(*args)  # on an error the step stays to be flushed again
        else:
            self._writing = self._writer.submit(self._write_or_warn, *args)
        self._calls, self._written = [], step
        return path

    def close(self) -> None:
        """Writes what is left and waits for the file (call it after the last backward)."""
        self.flush()

    def _join(self) -> None:
        """Waits for the background write of the last step handed off, and raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _write_or_warn(self, *args: Any) -> None:
        """`_write` in the background: its error is raised by the next flush or close, and warned of at once (a
        process that ends without `close` would not hear of it)."""
        try:
            self._write(*args)
        except BaseException as exc:
            warnings.warn(f"TrainingRecorder: step {args[1]} was not written ({type(exc).__name__}: {exc}); the next "
                          f"flush or close raises it", RuntimeWarning)
            raise

    def _write(self, path: Path, step: int, calls: list[tuple[int, int]], parts: list, host: _HostCopy,
               meta: dict[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols: dict[str, list] = {k: [] for k in ("sequence", "field", "value", "bits", "digest", "generation",
                                                 "micro_batch")}

        def add(seqs: list[str], field: str, value: list, bits: list, digest: list, call: tuple[int, int]) -> None:
            for k, v in zip(("sequence", "value", "bits", "digest"), (seqs, value, bits, digest)):
                cols[k] += v
            cols["field"] += [field] * len(seqs)
            cols["micro_batch"] += [call[0]] * len(seqs)
            cols["generation"] += [call[1]] * len(seqs)

        for call, (keys, scalars, vectors, digests) in zip(calls, _rebuild(parts, iter(host.tensors()))):
            seqs, none = sequence_keys(*keys), [None] * len(keys[0])
            for f, v in zip(SCALAR_FIELDS, scalars):
                add([f"rank{self.rank}/micro-batch{call[0]}"], f, [v.item()], [v.view(torch.int32).item()], [None],
                    call)
            for f, t in vectors.items():
                bits = t if f == "per_sequence_active_tokens" else t.view(torch.int32)
                add(seqs, f, [float(v) for v in t.tolist()], bits.tolist(), none, call)
            for f, d in zip(DIGEST_FIELDS, digests):
                if d is not None:
                    add(seqs, f, none, none, _hex(d), call)
        n = len(cols["sequence"])
        table = pa.Table.from_pydict({"step": [step] * n, **cols, "rank": [self.rank] * n, "order": list(range(n))},
                                     schema=schema())
        table = table.replace_schema_metadata({b"grpo_core": json.dumps(meta, sort_keys=True).encode()})
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)


def schema():
    import pyarrow as pa
    return pa.schema([("step", pa.int64()), ("sequence", pa.string()), ("field", pa.string()),
                      ("value", pa.float64()), ("bits", pa.int64()), ("digest", pa.string()),
                      ("generation", pa.int64()), ("micro_batch", pa.int64()), ("rank", pa.int64()),
                      ("order", pa.int64())])


def _version() -> str:
    from . import __version__
    return __version__
