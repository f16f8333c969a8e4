"""What the stages hand on to each other, on disk: each file's one writer and one reader.

    workdir.py        the work directory's file names (the one module that knows them)
    manifest.py       each stage's manifest: outputs, fingerprints, staleness, the run record
    records.py        the typed record each stage hands on in its manifest (docs/RECORDS.md)
    atomic.py         atomic writes and the disk-full check
    dataset.py        stage 01's splits and token counts
    vocab_map.py      stage 03's draft vocabulary mapping (d2t, t2d) and its arithmetic
    store/            stage 02's hidden-state store: format, writer, reader
    windows.py        the store's windows, for more data than the disk holds
    train_outputs.py  stage 04's checkpoints and metrics as the stages after it read them

Imports: eagle3.core only; never the drafter, the target, the serving format, an engine or
a stage (tests/unit/test_layout.py).
"""
