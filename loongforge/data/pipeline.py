"""Sample stream -> packed rows -> this rank's micro-batches, one training step at a time.

Every data-parallel rank reads and *measures* the whole global stream (tokens, media sizes from
headers) and runs the same packer, so all ranks see the same global row stream: step ``s`` is
rows ``s*G .. (s+1)*G - 1`` and DP rank ``r`` of ``D`` trains on rows ``r*G/D .. (r+1)*G/D - 1``
of it, one row per micro-batch. Only those rows are *materialized* (pixels decoded) here. The
rows therefore do not depend on the DP size.

The stream runs over epochs forever; epoch ``e`` visits every sample once, in a permutation drawn
from (data.seed, e) when data.shuffle. ``state_dict()`` is the exact position after the last step
returned (epoch, cursor, packing buffer, rejects seen), so a resumed run gets the same rows.

With ``balance.enabled`` the step's samples are re-assigned to ranks / micro-batches by
``loongforge.balance.apply.StepBalancer`` (metadata mode: every rank plans the same step from the
measurements it already has, then materialises only its own samples). The cost model used is part
of the state, so a resumed run makes the same plans.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import numpy as np

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.collate import RopeSettings, collate_row
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import MeasuredSample, SampleMeasurer, materialize, vision_sizing
from loongforge.data.packing import LookaheadPacker, PackItem, rank_rows
from loongforge.data.records import Reject
from loongforge.data.synthetic import SyntheticSamples
from loongforge.data.tokenizer import load_tokenizer

STATE_VERSION = 1


def build_sample_source(data_cfg: DataConfig) -> Union[FileSamples, SyntheticSamples]:
    if data_cfg.source == "synthetic":
        return SyntheticSamples(data_cfg.synthetic_num_samples, data_cfg.seed)
    if data_cfg.source == "files":
        if not data_cfg.paths:
            raise ValueError("data.source=files needs data.paths")
        return FileSamples(data_cfg.paths)
    raise ValueError(f"data.source={data_cfg.source!r} is not readable by DataPipeline (synthetic, files)")


class RejectLog:
    """Counts each reject once (by file, line, reason) and appends new ones to a JSONL file."""

    def __init__(self, path: Optional[Path]):
        self.path = Path(path) if path is not None else None
        self._seen: set[tuple[str, int, str]] = set()
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def record(self, reject: Reject) -> None:
        with self._lock:
            if reject.key in self._seen:
                return
            self._seen.add(reject.key)
            self._counts[reject.reason] += 1
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(reject.to_json(), ensure_ascii=False) + "\n")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def state_dict(self) -> dict:
        with self._lock:
            return {"seen": sorted([list(key) for key in self._seen]), "counts": dict(self._counts)}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._seen = {(f, int(line), reason) for f, line, reason in state["seen"]}
            self._counts = Counter(state["counts"])


class RowStream:
    """The global stream of packed rows (lists of MeasuredSample), identical on every rank."""

    def __init__(self, source, measurer: SampleMeasurer, *, seq_len: int, lookahead: int,
                 shuffle: bool, seed: int, rejects: RejectLog):
        self.source = source
        self.measurer = measurer
        self.shuffle = shuffle
        self.seed = seed
        self.rejects = rejects
        self.packer: LookaheadPacker[MeasuredSample] = LookaheadPacker(seq_len, lookahead)
        self.epoch = 0
        self.cursor = 0  # next position to read within the epoch's order
        self._orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            count = len(self.source)
            order = np.random.default_rng([self.seed, epoch]).permutation(count) if self.shuffle else np.arange(count)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep it small
            self._orders[epoch] = order
        return self._orders[epoch]

    def next_row(self) -> list[PackItem[MeasuredSample]]:
        """Items keyed by their stream position (epoch, cursor); payloads are the samples."""
        return self.packer.next_row(self._pull)

    def _pull(self) -> PackItem[MeasuredSample]:
        """Next accepted sample; rejects are logged and skipped."""
        for _ in range(len(self.source) + 1):
            position = (self.epoch, self.cursor)
            self.cursor += 1
            if self.cursor == len(self.source):
                self.epoch, self.cursor = self.epoch + 1, 0
            measured = self._measure_at(position)
            if isinstance(measured, MeasuredSample):
                return PackItem(key=position, length=measured.length, payload=measured)
            self.rejects.record(measured)
        raise RuntimeError(f"all {len(self.source)} samples were rejected; see the rejects file "
                           f"({self.rejects.counts()})")

    def _measure_at(self, position: tuple[int, int]) -> Union[MeasuredSample, Reject]:
        epoch, cursor = position
        sample = self.source.get(int(self.epoch_order(epoch)[cursor]))
        if isinstance(sample, Reject):
            return sample
        return self.measurer.measure(sample)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": [list(k) for k in self.packer.buffer_keys()]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        buffer = []
        for epoch, cursor in state["buffer"]:
            measured = self._measure_at((epoch, cursor))
            if not isinstance(measured, MeasuredSample):
                raise RuntimeError(f"buffered sample at epoch {epoch} position {cursor} no longer measures "
                                   f"(data changed since the checkpoint?): {measured}")
            buffer.append(PackItem(key=(epoch, cursor), length=measured.length, payload=measured))
        self.packer.buffer = buffer


class DataPipeline:
    """Training-step iterator for one data-parallel rank; see the module docstring.

    ``next_step()`` returns ``global_batch_size / dp_size`` micro-batch dicts (the contract is in
    ``loongforge.data.collate``). With ``data.num_workers >= 1`` a background thread prepares the
    next steps (and, above 1, decodes rows in parallel); results do not depend on it.
    ``last_data_wait_s`` is how long the latest ``next_step`` waited for data.
    """

    def __init__(self, data_cfg: DataConfig, model_cfg: ModelConfig, *, global_batch_size: int,
                 dp_rank: int, dp_size: int, pad_to_multiple: int, rejects_path: Optional[Path] = None,
                 lookahead: int = 32, prefetch_steps: int = 2, tokenizer=None,
                 balance_cfg=None, pipeline_parallel: int = 1, cost_model=None):
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        self.my_rows = rank_rows(global_batch_size, dp_rank, dp_size)
        self.global_batch_size = global_batch_size
        self.pad_to_multiple = pad_to_multiple
        self.pad_token_id = model_cfg.tokens.pad_token_id
        self.rope = RopeSettings.from_model_config(model_cfg)
        self.sizing = vision_sizing(data_cfg, model_cfg)
        self.num_workers = data_cfg.num_workers
        self.prefetch_steps = prefetch_steps
        self.rejects = RejectLog(rejects_path)
        measurer = SampleMeasurer(tokenizer or load_tokenizer(data_cfg.tokenizer), data_cfg, model_cfg)
        if data_cfg.source == "packed":  # rows come ready-packed from a `loongforge pack` folder
            from loongforge.data.packed import PackedFolder, PackedRowStream

            folder = PackedFolder(data_cfg.packed)
            folder.check_compatible(data_cfg.seq_len, self.sizing)
            self.stream = PackedRowStream(folder, shuffle=data_cfg.shuffle, seed=data_cfg.seed)
        else:
            self.stream = RowStream(build_sample_source(data_cfg), measurer, seq_len=data_cfg.seq_len,
                                    lookahead=lookahead, shuffle=data_cfg.shuffle, seed=data_cfg.seed,
                                    rejects=self.rejects)
        self.last_data_wait_s = 0.0
        self.dp_rank = dp_rank
        self._balancer = None
        self.balance_counters = None
        self.last_balance = None  # the latest consumed step's BalanceDecision (balance.enabled)
        if balance_cfg is not None and balance_cfg.enabled:
            from loongforge.balance.apply import BalanceCounters, StepBalancer

            # Pipeline parallelism synchronises every micro-batch slot, not just the step.
            self._balancer = StepBalancer(
                dp_size=dp_size, micro_batches=global_batch_size // dp_size, seq_len=data_cfg.seq_len,
                threshold=balance_cfg.threshold, objective="slots" if pipeline_parallel > 1 else "sum",
                cost_model=cost_model)
            self.balance_counters = BalanceCounters()
        self._step = 0
        self._consumed_state = self._stream_state()
        self._worker: Optional[_Prefetcher] = None
        self._pool = ThreadPoolExecutor(self.num_workers) if self.num_workers > 1 else None

    # ------------------------------------------------------------ public API

    def next_step(self) -> list[dict]:
        start = time.perf_counter()
        if self.num_workers >= 1:
            if self._worker is None:
                self._worker = _Prefetcher(self._produce_step, self.prefetch_steps)
            micro_batches, state, decision = self._worker.get()
        else:
            micro_batches, state, decision = self._produce_step()
        self.last_data_wait_s = time.perf_counter() - start
        self._consumed_state = state
        if decision is not None:
            self.last_balance = decision
            self.balance_counters.add(decision)
        return micro_batches

    @property
    def balance_cost_model(self):
        """The cost model balancing prices samples with (None when balancing is off)."""
        return self._balancer.cost_model if self._balancer is not None else None

    def set_cost_model(self, cost_model) -> None:
        """Price later steps with ``cost_model`` (None: token counts). Steps already prefetched
        with the old model are dropped and re-made, so the switch happens at the same consumed
        step on every rank."""
        if self._balancer is None:
            return
        from loongforge.balance.cost_model import token_count_model

        cost_model = cost_model or token_count_model()
        if cost_model.to_dict() == self._balancer.cost_model.to_dict():
            return
        self._stop_worker()
        self._rewind_to(self._consumed_state)
        self._balancer.cost_model = cost_model
        self._consumed_state = self._stream_state()

    def state_dict(self) -> dict:
        """Position after the last returned step; JSON-serialisable."""
        return {**self._consumed_state, "rejects": self.rejects.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')} != {STATE_VERSION}")
        self._stop_worker()
        self.rejects.load_state_dict(state["rejects"])
        self._rewind_to(state)

    def reject_counts(self) -> dict[str, int]:
        return self.rejects.counts()

    def close(self) -> None:
        """Stop the prefetch thread; the next ``next_step`` restarts it from the consumed position."""
        if self._stop_worker():
            self._rewind_to(self._consumed_state)

    def _stop_worker(self) -> bool:
        if self._worker is None:
            return False
        self._worker.stop()
        self._worker = None
        return True

    def _rewind_to(self, state: dict) -> None:
        # The prefetcher may have packed steps nobody consumed; start again from `state`.
        self.stream.load_state_dict(state["stream"])
        self._step = int(state["step"])
        if self._balancer is not None and state.get("balance_cost_model") is not None:
            from loongforge.balance.cost_model import CostModel

            self._balancer.cost_model = CostModel.from_dict(state["balance_cost_model"],
                                                            origin="data state")
        self._consumed_state = self._stream_state()

    # ------------------------------------------------------------ one step

    def _stream_state(self) -> dict:
        state = {"version": STATE_VERSION, "step": self._step, "stream": self.stream.state_dict()}
        if self._balancer is not None:  # plans are a function of the step's samples and this model
            state["balance_cost_model"] = self._balancer.cost_model.to_dict()
        return state

    def _produce_step(self) -> tuple[list[dict], dict, object]:
        """Measure + pack the step's global rows, materialize this rank's; runs in order."""
        rows = [[item.payload for item in self.stream.next_row()] for _ in range(self.global_batch_size)]
        self._step += 1
        state = self._stream_state()
        decision = None
        if self._balancer is not None:
            decision = self._balancer.decide(rows)
            samples = [s for row in rows for s in row]
            mine = [[samples[i] for i in mb] for mb in decision.micro_batches[self.dp_rank]]
        else:
            mine = [rows[i] for i in self.my_rows]
        if self._pool is not None:
            return list(self._pool.map(self._collate, mine)), state, decision
        return [self._collate(row) for row in mine], state, decision

    def _collate(self, row: list[MeasuredSample]) -> dict:
        materialized = [materialize(sample, self.sizing) for sample in row]
        for item in materialized:
            if item.late_reject is not None:
                self.rejects.record(item.late_reject)
        return collate_row(materialized, pad_to_multiple=self.pad_to_multiple,
                           pad_token_id=self.pad_token_id, rope=self.rope)


class _Prefetcher:
    """Runs ``produce`` in a daemon thread, keeping up to ``depth`` results ready, in order."""

    def __init__(self, produce, depth: int):
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loongforge-data", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                result = ("ok", self._produce())
            except BaseException as error:  # handed to the consumer, which re-raises it
                result = ("error", error)
            while not self._stop.is_set():
                try:
                    self._queue.put(result, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if result[0] == "error":
                return

    def get(self):
        kind, value = self._queue.get()
        if kind == "error":
            raise value
        return value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
