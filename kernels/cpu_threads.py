"""torch's CPU threads for a process: `set_cpu_threads(n)`, with `resolve_vml_dispatch()` first.

torch's CPU wheels hand float unary ops on contiguous tensors (sqrt, exp, log, ...) to oneMKL's VML,
each intra-op thread calling it on its chunk. oneMKL 2024.2, which torch 2.13's wheel bundles, picks
a VML function's kernel lazily, on its first call; when that first call runs on several threads at
once, one thread can run a low-accuracy kernel on its whole chunk (pytorch/pytorch#188792). In a
training run that first call is Adam's sqrt in batch 0: half of one weight tensor then takes
slightly different steps, and the run no longer matches an uninterrupted one bit for bit
(docs/testing.md: "A run's first VML call"). One call of each such op on one element, which no
thread splits, settles every choice before an op can run on several threads.
"""

from __future__ import annotations

import functools

import torch

# the unary ops ATen may route to VML (aten/src/ATen/cpu/vml.h), more rather than fewer: a call of
# an op that VML does not serve costs a microsecond and changes nothing
VML_OPS = ("abs", "acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "lgamma",
           "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan",
           "tanh", "trunc")


@functools.cache  # no lock: two threads resolving at once make one-element calls, which never split
def resolve_vml_dispatch() -> None:
    """Call every op of VML_OPS once on a one-element float and double tensor; once per process (a
    forked child inherits the settled choice with the parent's memory)."""
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            one = torch.full((1,), 0.5, dtype=dtype)
            for name in VML_OPS:
                getattr(torch, name)(one)


def set_cpu_threads(threads: int) -> None:
    """torch.set_num_threads(threads), VML's kernels chosen first (resolve_vml_dispatch)."""
    resolve_vml_dispatch()
    torch.set_num_threads(threads)
