"""Errors that reach the user as one clear line.

Everything cxltrain raises on purpose derives from `CxlTrainError`; the command line prints
`cxltrain: error: <message>` for these and exits non-zero, and never shows a traceback for them.
"""


class CxlTrainError(Exception):
    """Base of every error meant for the user."""

    # True where the process must end as soon as the line is out, skipping the interpreter's exit
    ends_process_at_once = False


class DeviceError(CxlTrainError):
    """The pool's backing file or device cannot be created, mapped or persisted."""


class PoolError(CxlTrainError):
    """A pool cannot be used as asked."""


class NotAPoolError(PoolError):
    """The file is not a cxltrain pool: too small, wrong magic, foreign contents."""


class PoolVersionError(PoolError):
    """The pool was written by a newer format, or asks for features this build lacks."""


class PoolCorruptError(PoolError):
    """A checksum or bound check failed: the bytes are not trusted, nothing is used."""


class PoolLockedError(PoolError):
    """Another process holds the pool open."""


class PoolFullError(PoolError):
    """A region does not fit in the space left in the pool."""


class ConfigError(CxlTrainError):
    """A user-given setting is out of range or inconsistent."""


class NonFiniteError(CxlTrainError):
    """A loss or gradient is NaN or infinite: the run stops before that batch is committed."""


class CheckpointError(CxlTrainError):
    """The checkpointer cannot make a batch durable as asked (no room, a state that does not fit)."""


class RecoveryError(PoolError):
    """A pool cannot be recovered into this model (it holds another model, or no committed state)."""


class TrainingStopped(CxlTrainError):
    """Training was asked to stop (SIGTERM) and stopped at a batch boundary, that batch committed."""
