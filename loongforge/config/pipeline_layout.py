"""Which language layers each pipeline stage holds: even stages, or ``parallel.pipeline_layout``.

A pipeline of PP ranks with VP virtual stages each has PP x VP stages in schedule order: virtual
stage 0 of ranks 0..PP-1, then virtual stage 1 of ranks 0..PP-1, and so on (megatron-core's
interleaved schedule). Language layers are numbered along that order, so rank r's chunk v holds
layers ``first_layer(r, v) ..``. Even stages give every stage num_layers / (PP x VP) layers.

``parallel.pipeline_layout`` is megatron-core's layout string (``pipeline_model_parallel_layout``),
which the model builder hands to megatron unchanged: stages separated by ``|``; in a stage ``E`` is
the embedding (here with the vision encoder and projector), ``t`` one language layer, ``m`` one
multi-token-prediction layer (``model.language.mtp_num_layers``, all in the last stage, before ``L``), ``L`` the LM
head and loss; ``x*n`` repeats a symbol, ``(...)*n`` a group (which may hold ``|``); commas are
cosmetic. For example ``Et|t*3|t*3|tL``, or ``E|(tt|)*3tL``.

Torch-free: config validation and the dry run read it before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from loongforge.config.schema import ParallelConfig

EMBEDDING, LAYER, MTP_LAYER, HEAD = "E", "t", "m", "L"
_SYMBOLS = {EMBEDDING, LAYER, MTP_LAYER, HEAD}


class LayoutSyntaxError(ValueError):
    """A pipeline layout string that does not parse."""


def virtual_stages(parallel: ParallelConfig) -> int:
    """VP: virtual_pipeline_model_parallel_size, or what the layout string implies, else 1."""
    if parallel.virtual_pipeline_model_parallel_size is not None:
        return parallel.virtual_pipeline_model_parallel_size
    if parallel.pipeline_layout is not None:
        stages = len(parse_stages(parallel.pipeline_layout))
        return max(1, stages // parallel.pipeline_model_parallel_size)
    return 1


def megatron_virtual_stages(parallel: ParallelConfig) -> int | None:
    """VP as megatron-core takes it: None for one chunk per rank."""
    vp = virtual_stages(parallel)
    return vp if vp > 1 else None


def parse_stages(text: str) -> list[str]:
    """The layout string expanded into one string of symbols per stage, schedule order."""
    expanded = _expand(text.replace(",", "").replace(" ", ""))
    stages = expanded.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - _SYMBOLS)
        if unknown:
            raise LayoutSyntaxError(f"unknown symbol {unknown[0]!r} in stage {stage!r} (use E, t, m, L, "
                                    f"x*n, (...)*n and |)")
    return stages


def _expand(text: str) -> str:
    """Unroll ``(group)*n`` (innermost first) and then ``x*n``."""
    while "(" in text:
        close = text.find(")")
        open_ = text.rfind("(", 0, close)
        if close < 0 or open_ < 0:
            raise LayoutSyntaxError(f"unbalanced parentheses in {text!r}")
        count, rest = _repeat_count(text[close + 1:], text)
        text = text[:open_] + text[open_ + 1:close] * count + rest
    if ")" in text:
        raise LayoutSyntaxError(f"unbalanced parentheses in {text!r}")
    out = []
    index = 0
    while index < len(text):
        if text[index] == "*":
            if not out:
                raise LayoutSyntaxError(f"'*' with nothing to repeat in {text!r}")
            count, rest = _repeat_count(text[index:], text)
            out.append(out.pop() * count)
            index = len(text) - len(rest)
        else:
            out.append(text[index])
            index += 1
    return "".join(out)


def _repeat_count(tail: str, whole: str) -> tuple[int, str]:
    """``*n...`` -> (n, what follows the digits)."""
    if not tail.startswith("*"):
        raise LayoutSyntaxError(f"a group must be followed by *n in {whole!r}")
    digits = len(tail) - 1 - len(tail[1:].lstrip("0123456789"))
    if digits == 0:
        raise LayoutSyntaxError(f"'*' must be followed by a count in {whole!r}")
    return int(tail[1:1 + digits]), tail[1 + digits:]


@dataclass(frozen=True)
class PipelineStages:
    """Language layers per stage: ``layers[r][v]`` for pipeline rank r, virtual stage v."""

    layers: tuple[tuple[int, ...], ...]  # [PP][VP]

    @property
    def pipeline(self) -> int:
        return len(self.layers)

    @property
    def virtual(self) -> int:
        return len(self.layers[0])

    def schedule_order(self) -> list[tuple[int, int]]:
        """(rank, virtual stage) of every stage, in the order the layers run."""
        return [(rank, stage) for stage in range(self.virtual) for rank in range(self.pipeline)]

    def first_layer(self, rank: int, stage: int) -> int:
        """The global index of the first language layer of rank ``rank``'s chunk ``stage``."""
        before = self.schedule_order().index((rank, stage))
        return sum(self.layers[r][v] for r, v in self.schedule_order()[:before])

    def rank_layers(self, rank: int) -> int:
        return sum(self.layers[rank])


def stage_plan(num_layers: int, parallel: ParallelConfig) -> PipelineStages:
    """The layers of every stage (assumes ``pipeline_layout_problems`` found nothing)."""
    pp, vp = parallel.pipeline_model_parallel_size, virtual_stages(parallel)
    if parallel.pipeline_layout is None:
        per_stage = num_layers // (pp * vp)
        return PipelineStages(tuple(tuple([per_stage] * vp) for _ in range(pp)))
    stages = parse_stages(parallel.pipeline_layout)
    return PipelineStages(tuple(tuple(stages[v * pp + r].count(LAYER) for v in range(vp)) for r in range(pp)))


def layout_string(plan: PipelineStages, mtp_layers: int = 0) -> str:
    """The layout string of a plan (embedding first, ``mtp_layers`` multi-token-prediction layers and the head last),
    for ``parallel.pipeline_layout``."""
    order = plan.schedule_order()
    stages = []
    for index, (rank, stage) in enumerate(order):
        count = plan.layers[rank][stage]
        text = LAYER if count == 1 else (f"{LAYER}*{count}" if count else "")
        last = index == len(order) - 1
        stages.append((EMBEDDING if index == 0 else "") + text + (MTP_LAYER * mtp_layers + HEAD if last else ""))
    return "|".join(stages)


@dataclass(frozen=True)
class PipelineKeys:
    """How the pipeline settings are named in messages: config keys, or a command's flags."""

    pipeline: str = "parallel.pipeline_model_parallel_size"
    virtual: str = "parallel.virtual_pipeline_model_parallel_size"
    layout: str = "parallel.pipeline_layout"


def pipeline_layout_problems(num_layers: int, parallel: ParallelConfig, *, first_stage_layers: int = 0,
                             first_stage_reason: str = "", keys: PipelineKeys = PipelineKeys(),
                             mtp_layers: int = 0) -> list[str]:
    """One sentence per way the pipeline split does not fit ``num_layers`` language layers (and ``mtp_layers``
    multi-token-prediction layers, which a layout places as ``m``).

    ``first_stage_layers``: layers the first stage must hold (Qwen3-VL's DeepStack adds vision
    features after the first k layers), ``first_stage_reason`` what needs them ("X needs" the first k)."""
    pp, vp_key = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if pp < 1:
        return []  # the size check names it
    if vp_key is not None and vp_key < 1:
        return [f"{keys.virtual}={vp_key} must be at least 1 (or null)."]
    errors = []
    if vp_key is not None and vp_key > 1 and pp == 1:
        errors.append(f"{keys.virtual}={vp_key} interleaves pipeline stages and needs {keys.pipeline} > 1; "
                      f"raise PP or leave it unset.")
    if parallel.pipeline_layout is None:
        errors += _even_problems(num_layers, pp, virtual_stages(parallel), keys)
    else:
        errors += _layout_problems(num_layers, parallel, keys, mtp_layers)
    if errors or not first_stage_layers:
        return errors
    held = stage_plan(num_layers, parallel).layers[0][0]
    if held < first_stage_layers:
        errors.append(f"the first pipeline stage holds {held} language layer{'s' * (held != 1)}, but "
                      f"{first_stage_reason} the first {first_stage_layers}, which must all be there; give it "
                      f"more ({keys.layout}) or lower the pipeline sizes.")
    return errors


def _even_problems(num_layers: int, pp: int, vp: int, keys: PipelineKeys) -> list[str]:
    stages = pp * vp
    if num_layers % stages == 0:
        return []
    valid = ", ".join(str(d) for d in range(1, num_layers + 1) if num_layers % d == 0)
    if vp == 1:
        return [f"{keys.pipeline}={pp} does not divide model.language.num_layers={num_layers}; set it to one "
                f"of {valid}, or place the layers with {keys.layout}."]
    return [f"{keys.pipeline}={pp} x {keys.virtual}={vp} = {stages} stages does not divide "
            f"model.language.num_layers={num_layers}; choose sizes whose product is one of {valid}, or place "
            f"the layers with {keys.layout}."]


def _layout_problems(num_layers: int, parallel: ParallelConfig, keys: PipelineKeys, mtp_layers: int) -> list[str]:
    pp, text = parallel.pipeline_model_parallel_size, parallel.pipeline_layout
    key = f"{keys.layout}={text!r}"
    try:
        stages = parse_stages(text)
    except LayoutSyntaxError as exc:
        return [f"{key}: {exc}."]
    vp_key = parallel.virtual_pipeline_model_parallel_size
    if len(stages) % pp or (vp_key is not None and len(stages) != pp * vp_key):
        wanted = (f"{keys.pipeline} x {keys.virtual} = {pp} x {vp_key} = {pp * vp_key}" if vp_key is not None
                  else f"a multiple of {keys.pipeline}={pp}")
        return [f"{key} has {len(stages)} stages; it needs {wanted} (stages are separated by |)."]
    errors = []
    layers = sum(stage.count(LAYER) for stage in stages)
    if layers != num_layers:
        errors.append(f"{key} places {layers} language layers; model.language.num_layers={num_layers}.")
    for symbol, position, name in ((EMBEDDING, 0, "embedding E"), (HEAD, len(stages) - 1, "LM head L")):
        where = [i for i, stage in enumerate(stages) if symbol in stage]
        if where != [position] or stages[position].count(symbol) != 1:
            errors.append(f"{key}: the {name} must appear once, in the {'first' if position == 0 else 'last'} "
                          f"stage.")
    if EMBEDDING in stages[0] and not stages[0].startswith(EMBEDDING):
        errors.append(f"{key}: E must open the first stage ({stages[0]!r}).")
    if HEAD in stages[-1] and not stages[-1].endswith(HEAD):
        errors.append(f"{key}: L must close the last stage ({stages[-1]!r}).")
    placed = stages[-1].count(MTP_LAYER)
    if placed != sum(stage.count(MTP_LAYER) for stage in stages) or placed != mtp_layers or (
            placed and not stages[-1].endswith(MTP_LAYER * placed + HEAD)):
        errors.append(f"{key}: model.language.mtp_num_layers={mtp_layers} multi-token-prediction layers go in the "
                      f"last stage as m, just before L (megatron runs them after the decoder); place {mtp_layers}.")
    return errors
