"""The hidden-state store: what stage 02 writes and stage 04 reads.

One module per audience (what each may import: torch, numpy, eagle3.artifacts' atomic,
errors, manifest and workdir; never a stage):

    format.py  file names, the encodings (bf16, fp8), the file layout, the identity
               (store.json, the store's one source of it), checksums; the docstring
               there describes every file of the store.
    writer.py  stage 02's side: partial files, finalization, index entries, index.json,
               the free-space check.
    reader.py  everyone else's: `HiddenStateStore.open(workdir, needed_by=...)`, the samples,
               `collate`.

Every name is re-exported here, so `from eagle3.artifacts.store import X` and
`from eagle3.artifacts import store; store.X` work for each of them.
"""
from eagle3.artifacts.store.format import *  # noqa: F401,F403
from eagle3.artifacts.store.writer import *  # noqa: F401,F403
from eagle3.artifacts.store.reader import *  # noqa: F401,F403
