"""The emulated CXL device's options, shared by `train` and `crashtest`: they set knobs."""

from __future__ import annotations

import argparse

from .. import knobs
from ..errors import ConfigError
from ..knobs import KNOBS
from .common import non_negative_int


def add_emulation_options(p) -> None:
    from ..knobs import DOMAINS

    g = p.add_argument_group("emulated CXL device (a pool on tmpfs/hugetlbfs; see README, Emulating CXL); "
                             "each option overrides its CXLTRAIN_* variable")
    g.add_argument("--power-loss", action="store_const", const=1, default=None,
                   help="model power loss: stores not persisted are lost when the process dies")
    g.add_argument("--domain", choices=DOMAINS, default=None,
                   help="with --power-loss, the persistence domain: adr (flush needed, the default), eadr "
                        "(caches persistent), none (volatile)")
    g.add_argument("--evict-rate", type=non_negative_int, default=None, metavar="R",
                   help="with --power-loss (adr), write up to R random unpersisted cache lines per second "
                        "back early, some torn at 8-byte boundaries, as write-back caches do (default 0)")
    g.add_argument("--persist-bandwidth", type=bandwidth, default=None, metavar="RATE",
                   help="cap persistence traffic at RATE bytes/s, e.g. 2.3G for one Optane DIMM's write "
                        "bandwidth (decimal units; default no cap)")


def bandwidth(text: str) -> int:
    """'2.3G', '500M', '1e9' → bytes per second (decimal units, as bandwidths are quoted)."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    scale = units.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (e.g. 2.3G, 500M)") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite rate of at least 1 byte per second")
    return int(value)


def emulation_knobs(args) -> dict:
    """The knobs the emulation options set: only those given, over the knobs' own values (and their
    CXLTRAIN_* variables). Checked together, as the device will see them."""
    given = {"power_loss": args.power_loss, "domain": args.domain, "evict_rate": args.evict_rate,
             "persist_bandwidth": args.persist_bandwidth}
    given = {name: value for name, value in given.items() if value is not None}
    with knobs.override(**given):
        KNOBS.validate()
        if "domain" in given and not KNOBS.power_loss:
            raise ConfigError("--domain needs --power-loss (or CXLTRAIN_POWER_LOSS=1): without the power-loss "
                              "model every store survives, whatever the domain")
    return given


def check_emulated(path: str, given: dict) -> None:
    """Refuses emulation options for a pool that the emulated device would not map."""
    from ..devices import resolve_backend

    if given and resolve_backend(path) != "emulated":
        raise ConfigError(f"--power-loss, --domain, --evict-rate and --persist-bandwidth model an emulated CXL pool; {path} is not "
                          f"on tmpfs/hugetlbfs (it maps with the {resolve_backend(path)} backend)")
