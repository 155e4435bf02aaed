"""balance.enabled with data.source=packed: ranks split each step's packed samples exactly."""

from loongforge.config.loader import load_run_config
from loongforge.data.pipeline import DataPipeline
from tests.pack.conftest import PRESET, SEQ_LEN
from tests.pack.test_packed_reader import _packed


def _pipeline(root, *, dp_rank, dp_size, enabled):
    cfg = load_run_config(PRESET, overrides=[f"data.packed={root}", "data.source=packed",
                                             f"data.seq_len={SEQ_LEN}", "data.num_workers=0",
                                             f"balance.enabled={str(enabled).lower()}", "balance.threshold=0"])
    return DataPipeline(cfg.data, cfg.model, global_batch_size=4, dp_rank=dp_rank, dp_size=dp_size,
                        pad_to_multiple=8, balance_cfg=cfg.balance)


def test_packed_balanced_steps_keep_every_sample(pack_inputs, tmp_path):
    _packed(pack_inputs, tmp_path / "packed")
    plain = _pipeline(tmp_path / "packed", dp_rank=0, dp_size=1, enabled=False)
    ranks = [_pipeline(tmp_path / "packed", dp_rank=r, dp_size=2, enabled=True) for r in range(2)]
    for _ in range(3):
        expected = sorted(sid for mb in plain.next_step() for sid in mb["sample_ids"])
        steps = [p.next_step() for p in ranks]
        assert [len(s) for s in steps] == [2, 2]
        got = sorted(sid for mbs in steps for mb in mbs for sid in mb["sample_ids"])
        assert got == expected
        assert all(sum(mb["sample_lengths"]) <= SEQ_LEN for mbs in steps for mb in mbs)
