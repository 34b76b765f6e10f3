"""Shared test helpers: seeded inputs, a float64 oracle-friendly generator, bitwise and verbose comparisons."""

from __future__ import annotations

import importlib.util
import os
import time
import zlib

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on the CPU (read at import time)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_core import LossContractError, raise_pending  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    # The deterministic path's row kernel reads CHUNK columns a loop iteration (4096 on a GPU). The interpreter's time
    # goes with the elements of a block, masked ones included, so a row of 17 columns cost it 4096; the bits do not
    # depend on the chunk (test_triton_canonical.py::test_many_chunks_tiles_and_odd_vocabularies runs 4096 too).
    from grpo_core.triton import canonical as _canonical_kernels  # noqa: E402

    _canonical_kernels.CHUNK = 256

    from triton.runtime import interpreter as _interpreter

    if hasattr(_interpreter, "_patch_lang") and hasattr(_interpreter, "_LangPatchScope"):
        # 30-40% of an interpreted test's time (`test_linear.py`'s chunk-size test: 48 s -> 29-35 s): the interpreter
        # patches `triton.language` (every builtin, found with `inspect.getmembers`) at each launch, which is needed,
        # and again at every call of a @triton.jit helper from a kernel, which finds the patch in place (a patched
        # builtin is a plain function) and sets the same thing again. Such a call skips it here when every language
        # module in the helper's globals is patched already; a module that is not (`triton.language.core`, which
        # `tl.zeros`' module calls) is patched as before.
        import triton.language as _tl

        _patch_lang = _interpreter._patch_lang
        _langs: dict = {}  # a helper's language modules in its globals (each kernel module of ours imports `tl`)

        def _patch_lang_unless_patched(fn):
            langs = _langs.get(fn)
            if langs is None:
                langs = _langs[fn] = [v for v in fn.__globals__.values() if v is _tl or v is _tl.core]
            if langs and not any(_tl.core.is_builtin(lang.load) for lang in langs):
                return _interpreter._LangPatchScope()
            return _patch_lang(fn)

        _interpreter._patch_lang = _patch_lang_unless_patched

torch.set_num_threads(int(os.environ.get("GRPO_TEST_THREADS", "1")))

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def make_inputs(B: int, T: int, V: int, *, seed: int = 0, dtype=torch.float32, active: float = 0.8,
                scale: float = 2.0, device: str = "cpu", empty_rows: tuple[int, ...] = (), wide: bool = False) -> dict:
    """Random GRPO inputs; `old_logps` sit near the true log-probs so ratios straddle the clip range.

    `wide=True` spreads the logits over many binary exponents (2**-12 .. 2**4): the vacuity guard under which a
    reordered sum visibly changes bits.
    """
    g = torch.Generator().manual_seed(seed)
    policy = torch.randn(B, T, V, generator=g) * scale
    if wide:
        policy = policy * torch.exp2(torch.randint(-12, 3, (B, T, V), generator=g).float())
    ref = policy + 0.3 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < active
    mask[:, 0] = True
    for row in empty_rows:
        mask[row] = False
    true_logp = torch.log_softmax(policy.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (true_logp + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    rewards = torch.randn(B, generator=g)
    out = dict(policy_logits=policy.to(dtype), ref_logits=ref.to(dtype), action_ids=ids, old_logps=old,
               rewards=rewards, completion_mask=mask)
    return {k: v.to(device) for k, v in out.items()}


def case_seed(*key) -> int:
    """A seed per test case that every run gives the same (Python's `hash` of a string changes per process)."""
    return zlib.crc32(repr(key).encode()) % 1000


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes: the only honest way to say 'bitwise equal'."""
    t = t.detach().contiguous()
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}.get(t.dtype)
    return t.view(view) if view is not None else t


def attempt(call, *args) -> tuple[str | None, str | None, float]:
    """A fault test's call on one rank: `(its LossContractError's message, any other exception, seconds)`; the world
    goes on whatever it raised."""
    error = other = None
    start = time.monotonic()
    try:
        call(*args)
    except LossContractError as exc:
        error = str(exc)
    except Exception as exc:  # a failure of the test: recorded, the world goes on if it can
        other = f"{type(exc).__name__}: {exc}"
    return error, other, time.monotonic() - start


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a).cpu() != bits(b).cpu()
    if bool(diff.any()):
        idx = torch.nonzero(diff)[:5].tolist()
        first = tuple(idx[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ bitwise, first at "
                             f"{idx}: {a.detach().cpu()[first].item()!r} vs {b.detach().cpu()[first].item()!r}")


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float,
                         what: str = "") -> None:
    """allclose with a report: how many elements miss, where the first ones are, the worst absolute error."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = (actual - expected).abs()
    bad = ~(err <= atol + rtol * expected.abs())
    if bool(bad.any()):
        idx = torch.nonzero(bad)[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements outside atol={atol} rtol={rtol}; "
                             f"first at {idx}; worst abs error {err.max().item():.3e}")


# Tests that feed values whose float32 sums overflow on purpose, to check the error that follows: numpy (the Triton
# interpreter's reductions) warns on the way. Filtered there only, so that a warning anywhere else still shows.
OVERFLOW_ON_PURPOSE = ("test_rewards_whose_group_statistics_overflow_are_refused_in_the_same_words",
                       "test_a_loss_that_overflows_float32_is_refused_in_the_same_words",
                       "test_what_is_found_after_the_chunks_raises_the_logits_ops_words")


def pytest_collection_modifyitems(items):
    for item in items:
        if getattr(item, "originalname", item.name) in OVERFLOW_ON_PURPOSE:
            item.add_marker(pytest.mark.filterwarnings(
                "ignore:(overflow|invalid value) encountered in reduce:RuntimeWarning"))


@pytest.fixture(autouse=True)
def no_pending_value_check():
    """A deferred value check (Triton on CUDA) left unread fails the test that left it, not the next one."""
    yield
    raise_pending()


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
