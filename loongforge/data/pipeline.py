"""Sample stream -> packed rows -> this rank's micro-batches, one training step at a time.

Every data-parallel rank reads and *measures* the whole global stream (tokens, media sizes from
headers) and runs the same packer, so all ranks see the same global row stream: step ``s`` is
rows ``s*G .. (s+1)*G - 1`` and DP rank ``r`` of ``D`` trains on rows ``r*G/D .. (r+1)*G/D - 1``
of it, one row per micro-batch. Only those rows are *materialized* (pixels decoded) here. The
rows therefore do not depend on the DP size.

The stream runs over epochs forever; epoch ``e`` visits every sample once, in a permutation drawn
from (data.seed, e) when data.shuffle. ``state_dict()`` is the exact position after the last step
returned (epoch, cursor, packing buffer, rejects seen), so a resumed run gets the same rows.

The rejects counted (summary, ``rejects.jsonl``, checkpoint) are those met making the steps the run
consumed, every rank's: a step's count when it is taken, never while a prefetching reader holds it,
so the figure is the same whatever the prefetch timing and, where the rows are, at every layout
(a rank decodes only its rows: what decoding finds is gathered over the DP group, ``_consumed_rejects``).

With weighted data.paths entries (``path@weight``, ``loongforge.data.mixture``) the stream is the
mixture's draw sequence instead, cut into blocks as long as an epoch would be: block ``e`` is
draws ``e*N .. (e+1)*N - 1`` for ``N`` samples, and each source keeps its own epochs. Positions,
shards, resume and the re-deal at another DP size work on blocks exactly as on epochs. The samples
and tokens trained per source are counted (``SourceCounts``) and saved with the position.

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
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Union

import numpy as np

from loongforge.balance.apply import BalanceCounters, StepBalancer, sample_size
from loongforge.balance.cost_model import token_count_model, with_vision_spread
from loongforge.config.errors import InputError
from loongforge.config.layout import resolve_read
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.collate import collate_row
from loongforge.data.embedding_store import EmbeddingStore, StoredMediaMeasurer, stored_feature_width
from loongforge.data.exchange import SampleExchange
from loongforge.data.fingerprint import check_files, counted_position, run_fingerprints
from loongforge.data.order import check_order, data_order
from loongforge.data.mixture import (
    Mixture,
    SourceCounts,
    build_mixture,
    check_entries_usable,
    check_same_weights,
    counts_report,
    entry_weights,
    redealt_counts,
    source_names,
    summed_counts,
)
from loongforge.data.measure import (
    MaterializedSample,
    MeasuredSample,
    SampleMeasurer,
    image_tokens,
    materialize,
    vision_sizing,
)
from loongforge.data.packfile.reader import PackedFolder, PackedRowStream
from loongforge.data.packing import LookaheadPacker, PackItem, rank_rows
from loongforge.data.preference import MeasuredPair, PairMeasurer, pack_pairs, pair_pack_item, row_pair_segments
from loongforge.data.redeal import DealtPositions, merged_rejects, redeal
from loongforge.data.samples import Reject, RejectKey
from loongforge.data.record_kinds import reading_for
from loongforge.data.streaming import (
    StreamingRowStream,
    StreamingSamples,
    measured_buffer,
    next_pending_piece,
    pack_items,
)
from loongforge.data.synthetic import SyntheticSamples
from loongforge.data.tokenizer import load_tokenizer
from loongforge.data.validation_data import SampleSubset, split_held_out
from loongforge.models.registry import get_family
from loongforge.parallel.data_groups import DataGroups, all_gather_objects, broadcast_object

STATE_VERSION = 1


def build_sample_source(data_cfg: DataConfig, text_only: bool = False, *, held_out: bool = False,
                        pairs: bool = False) -> Union[ArrowSamples, SyntheticSamples, SampleSubset]:
    """``text_only``: the model has no vision tower (generated samples carry no images). With
    ``data.valid_fraction`` the training samples, or with ``held_out`` the validation samples
    (``data.validation_data``). ``pairs``: every record a preference pair (``data.preference``)."""
    source = _whole_source(data_cfg, text_only, pairs)
    if not data_cfg.valid_fraction:
        return source
    training, validation = split_held_out(source, data_cfg.valid_fraction, data_cfg.seed)
    return validation if held_out else training


def _whole_source(data_cfg: DataConfig, text_only: bool, pairs: bool) -> Union[ArrowSamples, SyntheticSamples]:
    if data_cfg.source == "synthetic":
        return SyntheticSamples(data_cfg.synthetic_num_samples, data_cfg.seed, text_only=text_only)
    if data_cfg.source == "files":
        if not data_cfg.paths:
            raise ValueError("data.source=files needs data.paths")
        return ArrowSamples(list(data_cfg.paths), data_cfg.cache_dir, reading=reading_for(data_cfg, pairs=pairs))
    raise ValueError(f"data.source={data_cfg.source!r} is not readable by DataPipeline (synthetic, files)")


class RejectLog:
    """The rejects of the steps the run consumed: counts each once (by ``Reject.key``: file, line,
    record, reason) and appends new ones to a JSONL file. Streams record what they meet into a
    ``MetRejects``; a step's rejects reach this log when the step is consumed (``DataPipeline``), so
    the count, the file and the checkpointed state agree whatever the prefetch timing."""

    def __init__(self, path: Optional[Path]):
        self.path = Path(path) if path is not None else None
        self._seen: set[RejectKey] = set()
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def record(self, reject: Reject) -> None:
        self.record_all([reject])

    def record_all(self, rejects: list[Reject]) -> None:
        with self._lock:
            new: list[Reject] = []
            for reject in rejects:
                if reject.key not in self._seen and not self._seen_before_records(reject.key):
                    self._seen.add(reject.key)
                    self._counts[reject.reason] += 1
                    new.append(reject)
            if self.path is not None and new:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in new)

    def _seen_before_records(self, key: RejectKey) -> bool:
        """Whether a checkpoint saved before every record had its ordinal holds this reject: it keyed a
        record alone on its line by (file, line, reason), exact for those records."""
        file, line, record, reason = key
        return record is not None and (file, line, None, reason) in self._seen

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def state_dict(self) -> dict:
        """``seen``: [file, line, reason] per reject, with its record appended when it has one
        (so a state without records, as older checkpoints hold, reads the same)."""
        with self._lock:
            seen = [[f, line, reason] if record is None else [f, line, reason, record]
                    for f, line, record, reason in self._seen]
            return {"seen": sorted(seen), "counts": dict(self._counts)}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's rejects; the file keeps only those (once each): a run that went on past
        the checkpoint listed later ones, which the resumed run meets, and lists, again."""
        with self._lock:
            self._seen = {(f, int(line), int(record[0]) if record else None, reason)
                          for f, line, reason, *record in state["seen"]}
            self._counts = Counter(state["counts"])
            if self.path is not None and self.path.is_file():
                self._keep_listed_seen()

    def _keep_listed_seen(self) -> None:
        """Rewrite the file with its first line for each reject the loaded state has seen."""
        kept: dict[RejectKey, str] = {}
        for line in self.path.read_text(encoding="utf-8").splitlines():
            key = Reject(**json.loads(line)).key
            if key in self._seen:
                kept.setdefault(key, line)
        self.path.write_text("".join(line + "\n" for line in kept.values()), encoding="utf-8")


class MetRejects:
    """What a stream met while producing steps not yet handed on: the rejects of one step (each
    once), taken with the step (``DataPipeline._produce_step``) and counted when it is consumed.
    ``path``: the reject log's file, which a stream's errors name."""

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self._met: dict[RejectKey, Reject] = {}
        self._lock = threading.Lock()  # late rejects come from the decoding threads

    def record(self, reject: Reject) -> None:
        with self._lock:
            self._met.setdefault(reject.key, reject)

    def take(self) -> list[Reject]:
        """The rejects met since the last take, in key order (decoding threads finish in any order)."""
        with self._lock:
            met, self._met = self._met, {}
        return in_key_order(met.values())


def in_key_order(rejects) -> list[Reject]:
    """``rejects`` once each (by key), in key order: a step's rejects are listed in the same order
    whichever thread or rank met them."""
    unique: dict[RejectKey, Reject] = {}
    for reject in rejects:
        unique.setdefault(reject.key, reject)
    return sorted(unique.values(), key=lambda r: (r.file, r.line, -1 if r.record is None else r.record, r.reason))


class RowStream:
    """The global stream of packed rows (lists of MeasuredSample), identical on every rank."""

    def __init__(self, source, measurer: SampleMeasurer, *, seq_len: int, lookahead: int,
                 shuffle: bool, seed: int, rejects: RejectLog, shard: tuple[int, int] = (0, 1),
                 mixture: Optional[Mixture] = None, names: Optional[list[str]] = None, sample_multiple: int = 1):
        """``mixture``: weighted data.paths entries, whose draws replace the epochs' orders;
        ``names`` then names its sources (what the per-source counts are keyed by).
        ``sample_multiple``: samples take their length rounded up to it in a row (context parallelism)."""
        self.source = source
        self.mixture = mixture
        self.counts = SourceCounts(names) if mixture is not None else None
        self.measurer = measurer
        self.shuffle = shuffle
        self.seed = seed
        self.rejects = rejects
        self.packer: LookaheadPacker[MeasuredSample] = LookaheadPacker(seq_len, lookahead, sample_multiple)
        # Shard (i, n) reads positions i, i+n, i+2n, ... of each epoch's order (data.read=sharded).
        self.shard_index, self.shard_count = shard
        if len(source) <= self.shard_index:
            raise ValueError(f"{len(source)} samples cannot give every one of {self.shard_count} data-parallel "
                             "ranks a share; use more data or data.read=global")
        self.epoch = 0
        self.cursor = self.shard_index  # next position to read within the epoch's order
        # Positions a resume at another DP size dealt to this shard, read before its regular share.
        self.dealt = DealtPositions()
        self._orders: dict[int, np.ndarray] = {}
        self._rejected: dict[int, Reject] = {}  # sample index -> why it was rejected
        self.pieces: list[PackItem[MeasuredSample]] = []  # a long document's pieces still to pull
        self.dealt_pieces: deque = deque()  # [epoch, position, pieces] a re-deal gave this shard
        if mixture is not None:  # a weighted entry with nothing usable stops before its share is lost
            check_entries_usable(mixture, self.counts.names, self._reject_reason)

    def _reject_reason(self, index: int) -> Optional[str]:
        measured = self._measure_index(index)
        return measured.reason if isinstance(measured, Reject) else None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample index at each position of ``epoch`` (with a mixture: of its block of draws)."""
        if epoch not in self._orders:
            count = len(self.source)
            if self.mixture is not None:
                order = self.mixture.indices(epoch * count, count)
            elif self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(count)
            else:
                order = np.arange(count)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep it small
            self._orders[epoch] = order
        return self._orders[epoch]

    def next_row(self) -> list[PackItem[MeasuredSample]]:
        """Items keyed by their stream position (epoch, cursor); payloads are the samples."""
        row = self.packer.next_row(self._pull)
        if self.counts is not None:
            sources = self.mixture.sources([key[0] * len(self.source) + key[1] for key in (i.key for i in row)])
            for item, source in zip(row, sources.tolist()):
                self.counts.add(source, item.key, item.length)
        return row

    def next_pairs(self, count: int) -> list[PackItem[MeasuredPair]]:
        """The next ``count`` pairs of a stream of pairs (preference training's step: a number of pairs,
        packed into rows by ``preference.pack_pairs``); the packer's buffer is not used."""
        return [self._pull() for _ in range(count)]

    def source_report(self, counts: Optional[dict] = None) -> Optional[dict]:
        """Per source: samples and tokens trained (``counts``, e.g. summed over shards, else this
        stream's) and its epochs: the passes over it that the draws up to this stream's position
        make, less the samples the packer still holds (a shard's draw stands for one per shard)."""
        if self.counts is None:
            return None
        held = len(self.packer.buffer_keys()) * self.shard_count
        draws = max(0, self.epoch * len(self.source) + self.cursor - held)
        return counts_report(self.counts.names, counts or self.counts.state(), self.mixture.epochs(draws))

    def _pull(self) -> PackItem[MeasuredSample]:
        """Next accepted sample (or piece of a long document); rejects are logged and skipped."""
        piece = next_pending_piece(self.pieces, self.dealt_pieces, self._measure_at, self.packer.seq_len)
        if piece is not None:
            return piece
        while True:
            position = self._next_position()
            measured = self._measure_at(position)
            if isinstance(measured, MeasuredPair):  # a pair is one unit, never cut
                return pair_pack_item(tuple(position), measured, self.packer.sample_multiple)
            if isinstance(measured, MeasuredSample):
                first, *self.pieces = pack_items(position, measured, self.packer.seq_len)
                return first
            self.rejects.record(measured)
            self._check_some_accepted()

    def _next_position(self) -> tuple[int, int]:
        dealt = self.dealt.pop()
        if dealt is not None:
            return dealt
        position = (self.epoch, self.cursor)
        self.cursor += self.shard_count
        if self.cursor >= len(self.source):
            self.epoch, self.cursor = self.epoch + 1, self.shard_index
        return position

    def _reachable_count(self) -> int:
        """How many distinct samples this stream can ever read: all of them when epochs are
        shuffled (every sample lands in every shard sooner or later) or mixed (sources' epochs
        drift across blocks), else its fixed share."""
        if self.shuffle or self.mixture is not None:
            return len(self.source)
        return len(range(self.shard_index, len(self.source), self.shard_count))

    def _check_some_accepted(self) -> None:
        """Give up once every sample this stream can read is known to be rejected.

        Counted in distinct samples, not consecutive draws: a run of rejects may cross epoch
        boundaries, and a shard sees only every n-th position, so a draw count says nothing."""
        reachable = self._reachable_count()
        if len(self._rejected) < reachable:
            return
        counts = Counter(reject.reason for reject in self._rejected.values())
        by_reason = ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))
        share = (f" of this rank's share (data.read=sharded, rank {self.shard_index} of {self.shard_count}, "
                 f"data.shuffle=false)" if reachable < len(self.source) else "")
        where = f"; see {self.rejects.path}" if self.rejects.path is not None else ""
        raise InputError(f"all {reachable} samples{share} were rejected ({by_reason}){where}")

    def _measure_at(self, position: tuple[int, int]) -> Union[MeasuredSample, Reject]:
        epoch, cursor = position
        return self._measure_index(int(self.epoch_order(epoch)[cursor]))

    def _measure_index(self, index: int) -> Union[MeasuredSample, Reject]:
        if index in self._rejected:  # measuring is deterministic: a reject stays one
            return self._rejected[index]
        sample = self.source.get(index)
        measured = sample if isinstance(sample, Reject) else self.measurer.measure(sample)
        if isinstance(measured, Reject):
            self._rejected[index] = measured
        return measured

    def state_dict(self) -> dict:
        """``shard`` and ``dealt`` let a resume at another DP size deal the position again."""
        state = {"epoch": self.epoch, "cursor": self.cursor, "buffer": [list(k) for k in self.packer.buffer_keys()],
                 "pieces": [list(item.key) for item in self.pieces],
                 "dealt_pieces": [list(d) for d in self.dealt_pieces], "shard": [self.shard_index, self.shard_count],
                 "dealt": self.dealt.state()}
        return {**state, **self._mixture_state()}

    def _mixture_state(self) -> dict:
        """What a position in the draw sequence needs besides (epoch, cursor): the weights it was
        drawn with (a resume with others would read other samples) and the counts so far."""
        if self.mixture is None:
            return {}
        return {"mixture": self.mixture.weights.tolist(), "sources": self.counts.state()}

    def load_state_dict(self, state: dict) -> None:
        if "window_starts" in state:
            raise ValueError("the checkpoint's data position was saved by a streaming run; resume with "
                             "data.streaming=true")
        check_same_weights(state.get("mixture"), self.mixture.weights.tolist() if self.mixture is not None else None)
        if self.counts is not None:
            self.counts.load(state["sources"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.dealt = DealtPositions(state.get("dealt"))
        self.packer.buffer = measured_buffer(state["buffer"], self._measure_at, self.packer.seq_len)
        self.pieces = measured_buffer(state.get("pieces", []), self._measure_at, self.packer.seq_len)
        self.dealt_pieces = deque(state.get("dealt_pieces", []))

    def redealt(self, states: list[dict]) -> dict:
        """This shard's state continuing the saved ``states`` of all shards of a run at another DP
        size (``loongforge.data.redeal``). With a mixture, positions are dealt as they are (blocks
        of draws) and shard 0 carries on the counts of all old shards."""
        state = redeal(states, self.shard_count, len(self.source))[self.shard_index]
        if self.mixture is None:
            return state
        return {**state, "mixture": states[0].get("mixture"),
                "sources": redealt_counts([s["sources"] for s in states], self.shard_index)}


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
                 balance_cfg=None, pipeline_parallel: int = 1, cost_models=None,
                 groups: Optional[DataGroups] = None, encoder_ranks: int = 1,
                 embeddings: Optional[EmbeddingStore] = None, samples=None, held_out: bool = False,
                 sample_multiple: int = 1, dp_group=None, pairs: bool = False):
        """``sample_multiple``: each sample padded to a multiple of it inside its own segment of the
        row, and packed at that length (2 x CP under context parallelism, ``config.layout``).
        ``pairs``: preference training: every record a pair (``data.preference``), a step
        ``global_batch_size`` pairs packed into as many rows as they take, one process.
        ``dp_group``: this rank's data-parallel group (gloo: the ranks at its TP / PP / CP position in
        every DP rank), over which a step's rejects found decoding are gathered (``_consumed_rejects``)."""
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        self.read = resolve_read(data_cfg, dp_size)
        balancing = balance_cfg is not None and balance_cfg.enabled
        if self.read == "sharded" and groups is None and dp_size > 1 and balancing:
            raise ValueError("balancing with data.read=sharded at DP > 1 needs the data-exchange groups "
                             "(loongforge.parallel.data_groups.build_data_groups)")
        self.pairs = pairs
        self.my_rows = rank_rows(global_batch_size, dp_rank, dp_size)
        self.global_batch_size = global_batch_size
        self.pad_to_multiple = pad_to_multiple
        self.sample_multiple = sample_multiple
        self.pad_token_id = model_cfg.tokens.pad_token_id
        self.position_ids = get_family(model_cfg.family).position_ids(model_cfg)
        self.sizing = vision_sizing(data_cfg, model_cfg)
        # data.vision_embeddings: stored encoder features replace pixels (``data.embedding_store``).
        self.embeddings = embeddings
        self.embedding_width = stored_feature_width(model_cfg)
        self.num_workers = data_cfg.num_workers
        self.prefetch_steps = prefetch_steps
        self.rejects = RejectLog(rejects_path)  # the consumed steps' rejects
        self._met = MetRejects(self.rejects.path)  # the stream's, until their step is consumed
        self._decoded = MetRejects(self.rejects.path)  # found decoding this rank's rows, likewise
        # Reading global at DP > 1, each rank decodes only its own rows: the rejects found decoding
        # them (media corrupt past its header, a missing stored embedding) are gathered over the DP
        # group when the step is consumed. Without media nothing is found decoding: no collective.
        self._decoded_group = dp_group if self.read == "global" and dp_size > 1 and self.sizing is not None else None
        self.groups = groups
        # In sharded reading only each DP rank's leader loads; its TP / PP peers get its batches.
        self.loads_data = self.read == "global" or groups is None or groups.is_leader
        self.stream = None
        if self.loads_data:
            if held_out:  # data.valid_fraction's validation set, in place of the training samples
                samples = build_sample_source(data_cfg, text_only=self.sizing is None, held_out=True)
            self.stream = self._build_stream(data_cfg, model_cfg, tokenizer, lookahead, dp_rank, dp_size, samples)
        # What checkpoints record of data.paths, so a resume notices a changed file (data.fingerprint).
        self.data_files = (run_fingerprints(data_cfg.source, list(data_cfg.paths), getattr(self.stream, "source", None))
                           if self.stream is not None else None)
        self.accept_changed_files = data_cfg.accept_changed_files
        self.order = data_order(data_cfg)  # recorded in checkpoints: a resume in another order stops
        self.accept_new_order = data_cfg.accept_new_order
        self.resume_note: Optional[str] = None  # set by a resume that continued in changed data
        self.last_data_wait_s = 0.0
        # The latest epoch a sample of the latest step's rows was drawn in (None for pack folders
        # and streamed data, whose positions are not epochs): past 0, a set's samples repeat.
        self.last_row_epoch: Optional[int] = None
        self.dp_rank = dp_rank
        self._balancer = None
        self.balance_counters = None
        self.last_balance = None  # the latest consumed step's BalanceDecision (balance.enabled)
        if balancing:
            # Pipeline parallelism synchronises every micro-batch slot, not just the step.
            self._balancer = StepBalancer(
                dp_size=dp_size, micro_batches=global_batch_size // dp_size, seq_len=data_cfg.seq_len,
                threshold=balance_cfg.threshold, objective="slots" if pipeline_parallel > 1 else "sum",
                whole_rows=bool(model_cfg.language.moe and model_cfg.language.moe.loss_per_row))
            self.balance_counters = BalanceCounters()
        # The run's cost-model owner (train.balancing.RunBalancing): read, never pushed to, so every
        # rank switches models at the same consumed step. None: token counts throughout.
        self._cost_models = cost_models
        self._priced_version = None
        # Ranks sharing a replica's encoder work (parallel.encoder_dp): the planner prices the
        # vision terms at that parallel cost, so that plans stay balanced.
        self.encoder_ranks = encoder_ranks
        self._exchange = None
        if self.read == "sharded" and self.loads_data:
            self._exchange = SampleExchange(groups.exchange if groups is not None else None,
                                            dp_rank=dp_rank, dp_size=dp_size, balancer=self._balancer)
        self._step = 0
        self._consumed_state = self._stream_state()
        self._start_state = self._consumed_state  # restart(): a validation set's first step again
        # Weighted data.paths: per source, samples and tokens trained by all ranks up to the
        # latest consumed step, and its epochs (mixture.counts_report); None otherwise.
        self.last_sources: Optional[dict] = None
        self._worker: Optional[_StepWorker] = None
        self._pool = ThreadPoolExecutor(self.num_workers) if self.num_workers > 1 else None

    def source_text(self) -> str:
        """What this rank reads, for the start-up summary: the source and how many samples (rows
        for a pack folder) an epoch has, where known."""
        stream = self.stream
        if stream is None:
            return f"{self.read} reading, batches from this rank's data-parallel leader"
        if isinstance(stream, PackedRowStream):
            return f"pack folder, {len(stream.folder):,} packed rows per epoch"
        if isinstance(stream, StreamingRowStream):
            return f"streamed front to back in windows of {stream.source.window:,} records"
        share = f", this rank reads 1/{stream.shard_count}" if stream.shard_count > 1 else ""
        return f"{len(stream.source):,} samples per epoch{share}"

    @property
    def balance_mode(self) -> Optional[str]:
        """How plans are applied: "manifest" (every rank knows every sample; nothing moves),
        "exchange" (sizes gathered, samples moved), or None when balancing is off."""
        if self._balancer is None:
            return None
        return "exchange" if self.read == "sharded" else "manifest"

    def _build_stream(self, data_cfg: DataConfig, model_cfg: ModelConfig, tokenizer, lookahead: int,
                      dp_rank: int, dp_size: int, samples=None):
        """``samples``: a source to read instead of the one data_cfg names (``bench data`` passes
        the in-memory baseline reader)."""
        if data_cfg.source == "packed":  # rows come ready-packed from a `loongforge pack` folder
            folder = PackedFolder(data_cfg.packed)
            folder.check_compatible(data_cfg.seq_len, self.sizing, self.sample_multiple)
            return PackedRowStream(folder, shuffle=data_cfg.shuffle, seed=data_cfg.seed)
        measurer = SampleMeasurer(tokenizer or load_tokenizer(data_cfg.tokenizer), data_cfg, model_cfg)
        if self.embeddings is not None:
            measurer = StoredMediaMeasurer(measurer, self.embeddings)
        if self.pairs:
            measurer = PairMeasurer(measurer)
        shard = (dp_rank, dp_size) if self.read == "sharded" else (0, 1)
        if data_cfg.streaming:
            windows = StreamingSamples(list(data_cfg.paths), window=data_cfg.shuffle_window,
                                       shuffle=data_cfg.shuffle, seed=data_cfg.seed, reading=reading_for(data_cfg))
            return StreamingRowStream(windows, measurer,
                                      packer=LookaheadPacker(data_cfg.seq_len, lookahead, self.sample_multiple),
                                      rejects=self._met, shard=shard)
        samples = samples if samples is not None else build_sample_source(data_cfg, text_only=self.sizing is None,
                                                                           pairs=self.pairs)
        mixture = None
        if data_cfg.source == "files" and entry_weights(list(data_cfg.paths)) is not None:
            mixture = build_mixture(list(data_cfg.paths), samples.entry_spans(), seed=data_cfg.seed,
                                    shuffle=data_cfg.shuffle)
        return RowStream(samples, measurer, seq_len=data_cfg.seq_len,
                         lookahead=lookahead, shuffle=data_cfg.shuffle, seed=data_cfg.seed,
                         rejects=self._met, shard=shard, mixture=mixture, names=source_names(data_cfg.paths),
                         sample_multiple=self.sample_multiple)

    # ------------------------------------------------------------ public API

    def next_step(self) -> list[dict]:
        start = time.perf_counter()
        self._follow_cost_model()
        try:
            if self.num_workers >= 1:
                if self._worker is None:
                    self._worker = _StepWorker(self._produce_step, self.prefetch_steps)
                produced = self._worker.get()
            else:
                produced = self._produce_step()
        except InputError:  # e.g. every sample rejected: the file the message names lists them
            self.rejects.record_all(self._met.take())
            raise
        self.last_data_wait_s = time.perf_counter() - start
        self.rejects.record_all(self._consumed_rejects(produced))  # counted once consumed, never while prefetched
        self._consumed_state = produced.state
        self.last_row_epoch = produced.row_epoch
        self.last_sources = produced.sources
        micro_batches, decision = produced.micro_batches, produced.decision
        if decision is not None:
            self.last_balance = decision
            self.balance_counters.add(decision)
        return micro_batches

    def _consumed_rejects(self, produced: "_Produced") -> list[Reject]:
        """The step's rejects, every rank's: met measuring its rows (the same on every rank reading
        global; gathered by the exchange reading sharded) and found decoding them. Reading global at
        DP > 1 a rank decodes only its own rows, so those are gathered here, on the main thread
        where every rank of the group takes the step (the loader thread has no group of its own
        then). TP / PP / CP peers decode their DP rank's rows too and gather them over their own DP
        group: every rank counts the same rejects, as at DP 1."""
        decoded = produced.decoded
        if self._decoded_group is not None:
            decoded = [reject for rank_decoded in all_gather_objects(decoded, self._decoded_group)
                       for reject in rank_decoded]
        return in_key_order([*produced.rejects, *decoded])

    def _follow_cost_model(self) -> None:
        """Price the steps from here on with the owner's current model. Steps already prefetched
        with the old model are dropped and re-made, so the switch happens at the same consumed
        step on every rank."""
        if self._balancer is None or self._cost_models is None:
            return
        if self._cost_models.version == self._priced_version:
            return
        self._priced_version = self._cost_models.version
        cost_model = with_vision_spread(self._cost_models.cost_model or token_count_model(),
                                        self.encoder_ranks)
        if cost_model.to_dict() == self._balancer.cost_model.to_dict():
            return
        self._stop_worker()
        self._rewind_to(self._consumed_state)
        self._balancer.cost_model = cost_model

    def state_dict(self) -> dict:
        """Position after the last returned step; JSON-serialisable."""
        files = {"files": self.data_files} if self.data_files is not None else {}
        return {**self._consumed_state, "rejects": self.rejects.state_dict(), "order": self.order, **files}

    def load_state_dict(self, state: dict, *, saved_states: Optional[Callable[[], list[dict]]] = None,
                        checkpoint: str = "the checkpoint", saved_dp_size: Optional[int] = None) -> None:
        """``state``: the position this rank saved (or, after a layout change, the one it is handed).
        ``saved_states``: every rank's saved data state, read only when sharded reading resumes at
        another shard (a new DP size or DP rank), whose position is then dealt again exactly
        (``loongforge.data.redeal``); ``checkpoint`` names the checkpoint in errors, ``saved_dp_size``
        (its meta.json) checks a position saved without shards."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')} != {STATE_VERSION}")
        saved_read = state.get("read", "global")
        if saved_read != self.read:  # e.g. data.read=auto: sharded at DP 2, global at DP 1
            raise InputError(f"{checkpoint} holds the data position of data.read={saved_read}, this run reads "
                             f"data.read={self.read}: set data.read={saved_read} to resume (a sharded position "
                             "resumes at any data-parallel size)")
        new_order = check_order(state.get("order"), self.order, checkpoint=checkpoint,
                                accept_new=self.accept_new_order)
        if new_order is not None:  # data.accept_new_order: keep the rejects seen, start the data afresh
            self.resume_note = new_order
            self.rejects.load_state_dict(state["rejects"])
            return
        if self.read == "sharded" and isinstance(self.stream, (RowStream, StreamingRowStream)):
            state = self._own_share(state, saved_states, checkpoint, saved_dp_size)
        change = check_files(state.get("files"), self.data_files, accept_changed=self.accept_changed_files)
        if change is not None:  # data.accept_changed_files: continue from the recorded sample count
            if state["stream"].get("dealt") or state["stream"].get("dealt_pieces"):  # dealt from the old data
                raise InputError(f"{change}; {checkpoint} also resumes at another data-parallel size, whose "
                                 "positions are dealt from the old data: resume at the saved data-parallel size "
                                 "to continue on the changed files")
            count = len(self.stream.source) if isinstance(self.stream, RowStream) else None
            state = {**state, "stream": counted_position(state["stream"], count=count, first=self.stream.shard_index)}
            self.resume_note = (f"{change}; data.accept_changed_files=true: continuing at epoch "
                                f"{state['stream']['epoch']}, sample {state['stream']['cursor']} of the changed data")
        self._stop_worker()
        self.rejects.load_state_dict(state["rejects"])
        self._rewind_to(state)

    def _own_share(self, state: dict, saved_states, checkpoint: str, saved_dp_size: Optional[int]) -> dict:
        """The saved position of this rank's shard, dealt again from every shard's when the run
        was saved at another DP size; an InputError where that cannot be exact."""
        stream = self.stream
        here = [stream.shard_index, stream.shard_count]
        if state["stream"].get("shard") == here:
            return state
        if "shard" not in state["stream"]:  # saved before shards were recorded: only the same DP size
            if saved_dp_size in (None, stream.shard_count):
                return state
            raise InputError(f"{checkpoint} holds the data position of data.read=sharded at data-parallel size "
                             f"{saved_dp_size} without its shards (an older loongforge), this run has "
                             f"{stream.shard_count}: resume at data-parallel size {saved_dp_size}")
        states = saved_states() if saved_states is not None else [state]
        shards = [s["stream"].get("shard") for s in states]
        saved_count = state["stream"]["shard"][1]
        if any(shard is None for shard in shards):
            raise InputError(f"{checkpoint} holds the data position of data.read=sharded at data-parallel size "
                             f"{saved_count}, this run has {stream.shard_count}, and some of its rank files "
                             f"record no shard: resume at data-parallel size {saved_count}")
        by_index = {}
        for saved, shard in zip(states, shards):  # TP / PP peers hold copies of their leader's state
            by_index.setdefault(tuple(shard), saved)
        if {shard[1] for shard in by_index} == {stream.shard_count} and tuple(here) in by_index:
            return by_index[tuple(here)]  # same DP size, ranks mapped to DP ranks differently
        if len({int(s["step"]) for s in by_index.values()}) != 1:
            raise InputError(f"{checkpoint}: its rank files hold data positions of different steps; "
                             "the checkpoint is damaged")
        ordered = [by_index[key] for key in sorted(by_index)]
        try:
            stream_state = stream.redealt([s["stream"] for s in ordered])
        except ValueError as exc:
            raise InputError(f"{checkpoint}: its data positions cannot be dealt again ({exc}); "
                             f"resume at data-parallel size {saved_count}") from None
        return {**state, "stream": stream_state, "rejects": merged_rejects([s["rejects"] for s in states])}

    def restart(self) -> None:
        """Back to the first step: a validation set gives the same rows at every evaluation."""
        self._stop_worker()
        self._rewind_to(self._start_state)

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
        self._met.take()  # met making those steps: met again when they are made again
        self._decoded.take()
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        self._step = int(state["step"])
        if self.stream is None:  # a replica loads nothing: it keeps its leader's position as is
            self._consumed_state = dict(state)
            return
        self._consumed_state = self._stream_state()

    # ------------------------------------------------------------ one step

    def _stream_state(self) -> dict:
        stream = self.stream.state_dict() if self.stream is not None else None  # replicas: the leader's
        return {"version": STATE_VERSION, "step": self._step, "stream": stream, "read": self.read}

    def _produce_step(self) -> "_Produced":
        """One step's micro-batches, the stream position after it, the balance decision, the latest
        epoch its rows drew samples from, and the per-source counts of all ranks so far."""
        if self.read == "sharded":
            return self._produce_sharded_step()
        if self.pairs:
            return self._produce_pairs_step()
        # Global reading: measure + pack the step's global rows, materialize this rank's.
        items = [self.stream.next_row() for _ in range(self.global_batch_size)]
        rows = [[item.payload for item in row] for row in items]
        self._step += 1
        state = self._stream_state()
        decision = None
        if self._balancer is not None:
            decision = self._balancer.decide([[sample_size(s) for s in row] for row in rows])
            samples = [s for row in rows for s in row]
            mine = [[samples[i] for i in mb] for mb in decision.micro_batches[self.dp_rank]]
        else:
            mine = [rows[i] for i in self.my_rows]
        sources = self.stream.source_report() if isinstance(self.stream, (RowStream, StreamingRowStream)) else None
        micro_batches = self._map(self._collate, mine)
        return _Produced(micro_batches, state, decision, self._latest_epoch(items), sources, self._met.take(),
                         self._decoded.take())

    def _produce_pairs_step(self) -> "_Produced":
        """Preference training: the step's ``global_batch_size`` pairs, packed into rows whole, each row a
        micro-batch of whole pairs (one process: every row is this rank's)."""
        items = self.stream.next_pairs(self.global_batch_size)
        self._step += 1
        state = self._stream_state()
        micro_batches = self._map(self._collate_pairs, pack_pairs(items, self.stream.packer.seq_len))
        return _Produced(micro_batches, state, None, self._latest_epoch([items]), None, self._met.take(),
                         self._decoded.take())

    def _collate_pairs(self, pairs: list[MeasuredPair]) -> dict:
        """A row of whole pairs: segment 2i pair i's chosen side, 2i + 1 its rejected one; ``num_pairs``."""
        return {**self._collate(row_pair_segments(pairs)), "num_pairs": len(pairs)}

    def _produce_sharded_step(self) -> "_Produced":
        """Sharded reading: the leader reads its share's rows, exchanges, and hands the collated
        micro-batches to its TP / PP peers."""
        result = None
        if self.loads_data:
            items = [self.stream.next_row() for _ in self.my_rows]
            rows = [[item.payload for item in row] for row in items]
            self._step += 1
            state = self._stream_state()
            materialized = self._map(self._materialize, rows)
            # Every rank counts every rank's rejects of the step (rank 0 writes them).
            met = in_key_order([*self._met.take(), *self._decoded.take()])
            mine, decision, rejects = self._exchange.run(materialized, met)
            result = _Produced(self._map(self._collate_materialized, mine), state, decision,
                               self._latest_epoch(items), self._all_shards_sources(), rejects, [])
        if self.groups is not None and self.groups.replicas is not None:
            result = broadcast_object(result, self.groups.replicas_src, self.groups.replicas)
            if not self.loads_data:
                self._step = result.state["step"]
        return result

    def _latest_epoch(self, rows: list[list[PackItem]]) -> Optional[int]:
        """The latest epoch a sample of ``rows`` was drawn in (RowStream keys start with it)."""
        if not isinstance(self.stream, RowStream):
            return None
        return max((item.key[0] for row in rows for item in row), default=None)

    def _all_shards_sources(self) -> Optional[dict]:
        """The per-source report summed over the data-parallel shards (one gather of a few numbers
        on the exchange group, in step with the other leaders); None without a mixture."""
        if not isinstance(self.stream, (RowStream, StreamingRowStream)) or self.stream.counts is None:
            return None
        group = self.groups.exchange if self.groups is not None else None
        return self.stream.source_report(summed_counts(all_gather_objects(self.stream.counts.state(), group)))

    def _map(self, function, items: list) -> list:
        return list(self._pool.map(function, items)) if self._pool is not None else [function(x) for x in items]

    def _materialize(self, row: list[MeasuredSample]) -> list[MaterializedSample]:
        if self.embeddings is not None:
            materialized = [self.embeddings.materialize(sample, self.embedding_width, image_tokens(sample, self.sizing))
                            for sample in row]
        else:
            materialized = [materialize(sample, self.sizing) for sample in row]
        for item in materialized:
            if item.late_reject is not None:
                self._decoded.record(item.late_reject)
        return materialized

    def _collate_materialized(self, materialized: list[MaterializedSample]) -> dict:
        return collate_row(materialized, pad_to_multiple=self.pad_to_multiple,
                           pad_token_id=self.pad_token_id, position_ids=self.position_ids,
                           sample_multiple=self.sample_multiple)

    def _collate(self, row: list[MeasuredSample]) -> dict:
        return self._collate_materialized(self._materialize(row))


class _Produced(NamedTuple):
    """One step as ``DataPipeline._produce_step`` makes it (in the prefetch thread, or not)."""

    micro_batches: list  # this rank's micro-batch dicts
    state: dict  # the stream position after the step
    decision: object  # the balance decision (None without balancing)
    row_epoch: Optional[int]  # the latest epoch a sample of the step's rows was drawn in
    sources: Optional[dict]  # weighted data.paths: per-source counts of all ranks so far
    rejects: list  # the Rejects met making the step (all ranks', found decoding too, when reading sharded)
    decoded: list  # reading global: the Rejects found decoding this rank's rows (DataPipeline._consumed_rejects)


class _StepWorker:
    """Produces steps in a background thread, ``depth`` steps ahead of the consumer.

    New work is requested only by the consumer (one request per step taken), and ``stop`` lets
    every requested step finish: every rank therefore runs ``produce`` the same number of times,
    so collectives inside it (exchange mode) always find their peers, even while stopping.
    """

    def __init__(self, produce, depth: int):
        self._produce = produce
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        for _ in range(max(1, depth)):
            self._requests.put(True)
        self._thread = threading.Thread(target=self._run, name="loongforge-data", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._requests.get():
            try:
                self._results.put(("ok", self._produce()))
            except BaseException as error:  # handed to the consumer, which re-raises it
                self._results.put(("error", error))
                return  # later steps would wait on peers for a step this rank cannot make

    def get(self):
        kind, value = self._results.get()
        if kind == "error":
            raise value
        self._requests.put(True)
        return value

    def stop(self) -> None:
        self._requests.put(False)
        self._thread.join()
