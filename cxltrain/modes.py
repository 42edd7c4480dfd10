"""The names of the checkpointing choices, defined once: torch-free and importing nothing, so the
command line, the job's settings, the Runtime and the checkpointer all spell them the same way.

    checkpoint  UNDO   every batch durable (undo log, commit record per batch)
                OFF    the pool is made consistent only when the run ends
    mode        STRICT recovery exact: embeddings roll back to the last dense snapshot
                RELAXED embeddings committed every batch, the dense state every dense_every batches
"""

UNDO = "undo"
OFF = "off"
CHECKPOINTS = (UNDO, OFF)

STRICT = "strict"
RELAXED = "relaxed"
MODES = (STRICT, RELAXED)
