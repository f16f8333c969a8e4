"""Stage 01 on files with bad bytes (a gzip'd file with an invalid UTF-8 line, a truncated
gzip): each bad record counted by reason, the good ones kept, and `--strict` naming the
file and line. Two stage-01 runs on the tiny Llama; the readers themselves are tested in
tests/unit/test_chats.py."""
import gzip

import pytest
from fixtures import GOOD, GOOD_UNICODE, bad_utf8_line, good_line, numbered

from eagle3.artifacts.manifest import record_of
from eagle3.core.errors import PipelineError
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import prepare_dataset
from eagle3.target.chats import BadRecord, iter_records


def test_stage01_counts_bad_bytes_and_strict_names_file_and_line(tmp_path, tiny_llama):
    f = tmp_path / "chats.jsonl.gz"
    body = (b"".join(good_line(numbered(GOOD, i)) for i in range(4)) + bad_utf8_line()
            + b"".join(good_line(numbered(GOOD_UNICODE, i)) for i in range(2)))
    f.write_bytes(gzip.compress(body))
    cut = tmp_path / "cut.jsonl.gz"
    primes = b"".join(good_line({"messages": [{"role": "user", "content": f"Is {i * 7919} prime?"},
                                              {"role": "assistant", "content": f"{i * 7919 % 97} ..."}]})
                      for i in range(200))
    packed = gzip.compress(primes)
    cut.write_bytes(packed[: len(packed) // 2])
    m = prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama),
                                      data=[str(f), str(cut)], eval_fraction=0.0, num_workers=1))
    assert record_of(m).bad_records == {"invalid_utf8": 1, "truncated_gzip": 1}
    n_cut = sum(1 for r in iter_records(str(cut)) if not isinstance(r.record, BadRecord))
    assert 0 < n_cut < 200 and record_of(m).samples["train"] == 6 + n_cut
    with pytest.raises(PipelineError, match=r"chats\.jsonl\.gz:5: bad record \(invalid_utf8: byte 0xe9"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path / "w2", target_model=str(tiny_llama), data=[str(f)],
                                      strict=True, num_workers=1))
    assert not (tmp_path / "w2" / "01_dataset" / "manifest.json").exists()
