"""Stage 04 checks the store's aux layer ids against the target once, where it starts, before
it builds anything: a target with fewer layers than the store's ids need (the same hidden
size, vocabulary and tokenizer, so every other check passes) is refused naming store.json,
the ids and the fix, and no 04_train/ is created."""
import json
import shutil

import pytest
from fixtures import copy_stages

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter


def test_store_layers_beyond_the_target_are_refused_at_the_start(tmp_path, stages_123, tiny_llama, no_model_load):
    workdir = copy_stages(stages_123, tmp_path / "w")
    shallow = tmp_path / "shallow"
    shutil.copytree(tiny_llama, shallow)
    cfg = json.loads((shallow / "config.json").read_text())
    cfg["num_hidden_layers"] = 5  # the store holds [2, 4, 5] (the 8-layer default): 5 is past the last
    (shallow / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PipelineError, match=r"the aux layer ids of .*02_hidden_states/store\.json for .*shallow = "
                                            r"\[2, 4, 5\]: id\(s\) \[5\] out of range; pass the same --target-model as "
                                            r"stage 02, or rerun stage 02 with --force and ids in \[1, 4\]"):
        train_drafter(TrainConfig(work_dir=workdir, target_model=str(shallow), device="cpu", max_steps=1))
    assert not WorkDir(workdir).stage_dir("train").exists()
