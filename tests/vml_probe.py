"""One fresh process's first VML call (kernels/cpu_threads.py), run by tests/test_cpu_threads.py.

Sets two torch threads, through cxltrain's set_cpu_threads or, with argv[1] == "plain", through
torch alone, then compares the process's first sqrt of 6,656 floats (which VML splits between the
two threads, and which also starts the thread pool) with a second one. Prints 1 if they differ."""

import sys

import torch


def main(plain: bool) -> None:
    if plain:
        torch.set_num_threads(2)
    else:
        from cxltrain.kernels.cpu_threads import set_cpu_threads
        set_cpu_threads(2)
    x = torch.arange(1, 6657, dtype=torch.float32) / 6656  # [6656], (0, 1]
    first = torch.sqrt(x)
    print(int(not torch.equal(first, torch.sqrt(x))))


if __name__ == "__main__":
    main(sys.argv[1:] == ["plain"])
