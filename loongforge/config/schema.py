"""The one typed schema for a loongforge run.

Every YAML preset, user config file and ``key=value`` override is resolved into these
dataclasses (see ``loongforge.config.loader``), and every check that spans fields lives in
``loongforge.config.validate``. Field names mirror transformers' Qwen2.5-VL config where a
counterpart exists, so checkpoint maps and parity tests stay nearly identity.

Defaults are the published Qwen2.5-VL-7B numbers unless a comment says otherwise; the model family
and the vision tower have none (presets name them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from loongforge.config.language_parts import LAYER_TYPES, LinearAttentionConfig, MLAConfig, MoEConfig, YarnConfig
from loongforge.config.language_parts import SlidingWindowConfig, SparseAttentionConfig
from loongforge.config.preference import PreferenceConfig
from loongforge.config.vision_parts import AnyresConfig, WindowAttentionConfig


@dataclass
class VisionConfig:
    """The ViT encoder (``visual`` in transformers), without the patch merger."""

    # The vision tower part (``models.parts``: a folder under ``models/towers/``); null: the family's
    # own (a composition names one). A family accepts the tower it is composed of and refuses others
    # in one line. The schema names no tower: presets and HF folders do.
    arch: Optional[str] = None
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    # Window attention (Qwen2.5-ViT): its window and the blocks that see the whole image; null: every block
    # sees the whole image (Qwen3-VL, InternViT, SigLIP).
    window: Optional[WindowAttentionConfig] = field(
        default_factory=lambda: WindowAttentionConfig(size=112, fullatt_block_indexes=[7, 15, 23, 31]))
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    # Block norms: rms (Qwen2.5-VL: RMSNorm) or layer (Qwen3-VL: LayerNorm with bias).
    norm: str = "rms"
    # Qwen3-VL: a learned position-embedding grid of this many (a square) positions, resampled to
    # each image's grid; null: none (Qwen2.5-VL).
    num_position_embeddings: Optional[int] = None
    # Qwen3-VL DeepStack: vision blocks whose merged features are added after decoder layers 0..k-1.
    deepstack_layers: list[int] = field(default_factory=list)
    # Towers that see fixed-size square inputs (InternViT's 448-pixel tiles): the side in pixels, which
    # fixes the learned position table; null: any grid (Qwen's towers).
    image_size: Optional[int] = None
    # anyres tiling of a sample's only image (LLaVA-OneVision's processor); null: none.
    anyres: Optional[AnyresConfig] = None
    # InternViT-6B's blocks: no q, k, v biases (qkv_bias=false) and an RMSNorm over all heads' queries
    # and keys (qk_norm=true); the Qwen towers and InternViT-300M have biases and no such norm.
    qkv_bias: bool = True
    qk_norm: bool = False
    # The image processor's per-channel normalisation (image_mean / image_std): OpenAI CLIP's for
    # Qwen2.5-VL, 0.5 / 0.5 for Qwen3-VL.
    pixel_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    pixel_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])


@dataclass
class ProjectorConfig:
    """The patch merger: RMSNorm, then an MLP over each 2x2 group of patch features."""

    # The projector kind its vision tower builds (``models.parts.TowerPart.projectors``); null: the
    # tower's own.
    arch: Optional[str] = "patch_merger"
    spatial_merge_size: int = 2
    hidden_act: str = "gelu"
    # Must equal language.hidden_size: the merger writes straight into the text embeddings.
    out_hidden_size: int = 3584


@dataclass
class LanguageConfig:
    """The decoder (``language_model`` in transformers): Qwen2, Qwen3 or Llama blocks."""

    # The transformers text architecture these layers are (``Qwen2ForCausalLM``, ``LlamaForCausalLM``, ...;
    # its ``architectures`` entry), stated by a family whose decoder is configurable (it decides the HF
    # export and the chat format); null: the family's own decoder. Configs saved before it was stated
    # read it from add_qkv_bias / qk_norm / moe / the router.
    architecture: Optional[str] = None
    num_layers: int = 28
    hidden_size: int = 3584
    ffn_hidden_size: int = 18944
    num_attention_heads: int = 28
    # GQA: number of key/value heads.
    num_query_groups: int = 4
    vocab_size: int = 152064
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # M-RoPE: rotary pairs given to the temporal, height and width position ids; sums to head_dim/2.
    # Empty for a text-only model (plain 1-D RoPE).
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    # Qwen3-VL: the sections interleave t, h, w over the rotary frequencies instead of taking
    # three contiguous blocks (Qwen2.5-VL).
    mrope_interleaved: bool = False
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = True
    # Channels per head; null: hidden_size / num_attention_heads (Qwen3 may set it otherwise).
    head_dim: Optional[int] = None
    # RMSNorm over each head's query and key before RoPE (Qwen3).
    qk_norm: bool = False
    # What the q/k norms span: "per_head" (Qwen3: each head's channels, one weight shared by the heads) or
    # "per_layer" (MiniMax-M2: all heads of q at once, and of k, a weight per channel).
    qk_norm_type: str = "per_head"
    # RoPE scaling's factor (null: none), applied as ``rope_scaling_type`` says: "llama3", Llama 3.x's
    # frequency scaling (low/high frequency factors 1 and 4, original context 8192), at every length;
    # "dynamic", NTK-aware base growth past max_position_embeddings only (InternVL2.5's Qwen2.5 decoders
    # state it): plain RoPE at every length a run trains (data.seq_len <= max_position_embeddings).
    rope_scaling_factor: Optional[float] = None
    rope_scaling_type: str = "llama3"
    # Routed experts in place of the dense MLP (its own section: experts, router, shared expert, leading
    # dense layers); null: a dense model (the SwiGLU MLP of ffn_hidden_size in every layer).
    moe: Optional[MoEConfig] = None
    # Hybrid models (Qwen3.5): each layer's token mixer, "full_attention" or "linear_attention"
    # (transformers' ``layer_types``); empty: every layer full attention.
    layer_types: list[str] = field(default_factory=list)
    # The linear-attention layers' shape; null unless ``layer_types`` names some.
    linear_attention: Optional[LinearAttentionConfig] = None
    # Full attention multiplies its output by sigmoid(gate), the gate a second half of each query head's
    # projection (Qwen3.5).
    attention_output_gate: bool = False
    # Share of each head's channels that RoPE rotates (Qwen3.5: 0.25); the rest pass unrotated.
    partial_rotary_factor: float = 1.0
    # RMSNorms scale by (1 + weight), the weight starting at zero (Qwen3.5, Gemma).
    zero_centered_norms: bool = False
    # Multi-latent attention in place of GQA (DeepSeek-V2/V3); null: GQA (num_query_groups, head_dim).
    multi_latent_attention: Optional[MLAConfig] = None
    # YaRN RoPE scaling (with multi-latent attention); null: plain RoPE.
    yarn: Optional[YarnConfig] = None
    # Multi-token prediction (DeepSeek-V3): this many extra layers after the decoder, the k-th predicting the
    # token k+1 ahead from the (k-1)-th's hidden state and the next token's embedding, sharing the embedding
    # and the output head; 0: none.
    mtp_num_layers: int = 0
    # Their loss's weight: the step's objective adds mtp_loss_coeff / mtp_num_layers x their token losses.
    mtp_loss_coeff: float = 0.1
    # MiMo-V2-Flash's attention (sliding-window layers with sinks, narrower values; ``layer_types`` names the
    # sliding_attention layers); null: none.
    sliding_window: Optional[SlidingWindowConfig] = None
    # DeepSeek Sparse Attention on the multi-latent attention (DeepSeek-V3.2): a lightning indexer chooses the
    # keys each query attends to; null: every earlier key of the sample.
    sparse_attention: Optional[SparseAttentionConfig] = None


@dataclass
class TokenIdsConfig:
    """Special token ids of the Qwen2 vocabulary the model and data pipeline agree on."""

    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    pad_token_id: int = 151643


@dataclass
class ModelConfig:
    # Registry key selecting the model family implementation (see loongforge.models.registry). The schema
    # names no family: every preset and every written config.yaml does, and a config that names none is
    # refused in one line listing the families (``models.registry.get_family``).
    family: str = ""
    # null in a text-only model (a language-model family: no vision tower, no merger).
    vision: Optional[VisionConfig] = field(default_factory=VisionConfig)
    projector: Optional[ProjectorConfig] = field(default_factory=ProjectorConfig)
    language: LanguageConfig = field(default_factory=LanguageConfig)
    tokens: TokenIdsConfig = field(default_factory=TokenIdsConfig)
    # Video frames per second of position time; Qwen2.5-VL uses 2 temporal ids per second.
    tokens_per_second: int = 2
    # What the transformer blocks of both towers are built from (loongforge.models.layers.layer_backend):
    # te (Transformer Engine norm-linear, linears, attention), flash (local linears, flash-attn),
    # varlen (local linears, torch's varlen attention: torch >= 2.10, CUDA, bf16/fp16), sdpa (local
    # linears, torch SDPA; runs anywhere). auto: the first of te, flash, varlen, sdpa that can run the
    # device and precision. Checkpoints do not depend on the choice.
    layer_backend: str = "auto"
    # Published parameter count, checked by tests against the architecture arithmetic.
    reference_num_params: Optional[int] = None
    # A text-only model's chat format by name (chatml, qwen3, llama3, deepseek_v3, llama2); null: the format of
    # its architecture's instruct models. A model trained from scratch with another family's tokenizer
    # (deepseek-v3-tiny with Qwen's) takes that tokenizer's format. A family whose versions share one
    # architecture but not one template names the version's (qwen3.5[-nothink], qwen3.6,
    # qwen3.8[-medium|-low]); each family refuses the names that are not its own.
    chat_format: Optional[str] = None


# model.chat_format's names: the text family's (models.llm.chat), then the template versions of one
# vision-language architecture (a family's own chat module).
CHAT_FORMATS = ("chatml", "qwen3", "llama3", "deepseek_v3", "llama2", "qwen3.5", "qwen3.5-nothink", "qwen3.6",
                "qwen3.8", "qwen3.8-medium", "qwen3.8-low")


@dataclass
class DataConfig:
    # "synthetic" uses the built-in generator; "files" reads `paths`; "packed" reads a `loongforge pack` folder.
    source: str = "synthetic"
    # Files, folders or hf:NAME datasets. "path@weight" on every entry makes a weighted mixture:
    # sources drawn in proportion to the weights, exactly over any window, each source with its own
    # epochs, per-source counts in metrics.jsonl (loongforge/data/mixture.py, docs/data.md). Without
    # weights one epoch visits every sample once.
    paths: list[str] = field(default_factory=list)
    packed: Optional[str] = None
    # Samples drawn from the synthetic generator (an epoch); ignored for files.
    synthetic_num_samples: int = 2000
    # Tokens per packed row (the language model's sequence length; the whole row's under context
    # parallelism, each CP rank holding seq_len / CP of it).
    seq_len: int = 4096
    # Every sample padded (inside its own segment of the row) to a multiple of this, and packed at
    # that length; null: what parallel.context_parallel_size needs (2 x CP; 1 without CP). Set, it must
    # be a multiple of 2 x CP. Fixing it keeps the rows of a run the same at every CP size (a CP 2
    # run and a CP 1 run with data.sample_multiple=4 train on identical rows).
    sample_multiple: Optional[int] = None
    # "qwen" (Qwen2/2.5), "qwen3" (Qwen3, Qwen3-VL: Qwen2.5's plus <think> and tool-response tokens)
    # or "llama3" (Llama 3.x) builds that BPE offline from the ranks an installed
    # package ships (loongforge.data.tokenizer); otherwise a local HF tokenizer directory.
    tokenizer: str = "qwen"
    # The Hub repository a local tokenizer folder (``tokenizer`` as a path) is downloaded from: the
    # error for a missing folder names it (Qwen3.5's and DeepSeek's tokenizers ship in no package).
    tokenizer_repo: Optional[str] = None
    # Image sizing, in pixels, with Qwen2.5-VL's smart-resize rules (the Qwen towers).
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # InternViT's tiling: an image becomes at most this many tiles of model.vision.image_size pixels
    # (and a thumbnail when it takes more than one): InternVL's processor's max_patches.
    max_tiles: int = 12
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_fps: float = 2.0
    video_max_frames: int = 32
    # The system turn of conversations that have none: null = the model's own template's default
    # (Qwen2.5's "You are a helpful assistant."; none for Qwen3 and Qwen3-VL), "" = none.
    system_prompt: Optional[str] = None
    # What the records of data.paths are (loongforge/data/record_kinds.py): "auto" recognises each
    # record by its fields (messages/conversations, then instruction+output, then caption, then
    # text), so one run mixes chat, Alpaca, caption and pretraining files; "conversation", "text",
    # "alpaca" or "caption" reads every record as that kind. Lines of .txt files are always text.
    record_kind: str = "auto"
    # Text after the image in the user turn of caption records (e.g. "Describe the image."); null =
    # the image alone. Loss is on the caption only either way.
    caption_prompt: Optional[str] = None
    shuffle: bool = True
    seed: int = 1234
    num_workers: int = 1
    # Who reads what. "global": every DP rank reads and measures every sample (no pixels) and
    # trains its share of the global rows, which then do not depend on the DP size. "sharded":
    # each DP rank reads 1/DP of the samples (tokenizing and probing only those), the scalable
    # choice for raw files at large DP; balancing then exchanges samples between ranks. A sharded
    # run resumes at another DP size (or TP x PP layout) exactly: each rank file records its shard,
    # and the positions no shard trained are dealt again to the new ranks (data/redeal.py; a
    # streamed read counts its records once to do so).
    # "auto": sharded for data.source=files at DP > 1, else global.
    read: str = "auto"
    # Where Arrow copies of data files are kept (built once per node by its first process, keyed
    # by content, memory-mapped by all); null = <LOONGFORGE_CACHE or ~/.cache/loongforge>/datasets.
    # Put it on node-local disk.
    cache_dir: Optional[str] = None
    # Read data.paths front to back instead of through the Arrow cache, for inputs too large to
    # copy: memory holds one window of data.shuffle_window records, each window shuffled on its
    # own (data.shuffle); a checkpoint saves the position, so resuming gives the same samples.
    # The data.paths entries are mixed, each in proportion to its bytes on disk (equal shares with a
    # hub dataset among them) or to its @weight, so every stretch of steps sees every entry, not one
    # after another.
    streaming: bool = False
    shuffle_window: int = 4096
    # A checkpoint records each data file's fingerprint (size and content hash), and a resume whose
    # files changed since refuses, naming the file: the saved position (byte offsets, sample
    # indices) would point at other samples. true: resume anyway, from the recorded sample count
    # (same epoch, same number of samples into it) in the changed data; the samples the packer held
    # at the checkpoint are dropped.
    accept_changed_files: bool = False
    # A checkpoint records data.seed, data.shuffle and data.valid_fraction: its data position indexes
    # the order they draw, and a resume with others stops (it would train samples twice and others
    # never). true: where they changed, start the data afresh at epoch 0 in this run's order (the
    # model, optimizer and schedule continue); a resume in the recorded order continues as usual.
    accept_new_order: bool = False
    # A `loongforge encode` folder: the vision encoder is neither built nor run, and each sample's
    # image/video positions take its stored embeddings (checked at start against this run's
    # encoder weights and processor settings; a sample without them is a `missing_embedding` reject).
    vision_embeddings: Optional[str] = None
    # Validation sets (training.eval_interval): each entry "name=path" or a path (the set is then
    # named after the file); entries that share a name form one set. The formats of data.paths.
    # Every rank reads each set whole (data.read=global), packed and balanced like training data.
    valid_paths: list[str] = field(default_factory=list)
    # Hold this share of the training samples out as a validation set named "heldout": the same
    # samples for the same files and data.seed (never trained on); 0 = none. Indexed data only
    # (data.source=files or synthetic, not streamed).
    valid_fraction: float = 0.0


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Interleaved (virtual) pipeline: each pipeline rank holds this many model chunks and megatron-core's
    # interleaved 1F1B schedule runs them round-robin, dividing the bubble by about this factor for
    # more point-to-point messages. Needs PP > 1 and the micro-batches a rank runs per step a multiple
    # of PP. null (or 1): one chunk per rank.
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Which layers each pipeline stage holds, megatron-core's layout string: the PP x VP stages in
    # schedule order (virtual stage 0 of ranks 0..PP-1, then virtual stage 1, ...) separated by "|";
    # "E" the embedding with the vision encoder and projector (first stage only), "t" one language
    # layer ("t*3" three), "L" the LM head and loss (last stage only); e.g. "Et|ttt|ttt|tL" is PP 2 x
    # VP 2 over 8 layers with one layer beside the encoder. null: layers split evenly.
    pipeline_layout: Optional[str] = None
    # Tensor parallel size of the vision encoder; null = same as the language model.
    vision_tensor_model_parallel_size: Optional[int] = None
    # How the vision encoder's work is divided beyond its own TP: "none" runs the whole encoder on
    # every rank of a language TP group (all on the same images); "tp" divides the group's images
    # and videos among its ranks by modelled cost and gathers the embeddings (needs vision TP 1);
    # "full" divides all media of a step's micro-batches among the TP x PP ranks of a model-parallel
    # group (every stage holds an encoder replica) before the pipeline runs (needs vision TP 1).
    encoder_dp: str = "none"
    # encoder_dp=full: encode the step's media without keeping the graph and encode them again in
    # the backward, one micro-batch's patches at a time, so a rank holds no more encoder
    # activations than encoder_dp=none (plus the gathered features) for a second encoder forward;
    # off, a rank keeps micro-batches / (TP x PP) micro-batches' encoder activations through the
    # step (the dry run states both).
    encoder_full_recompute: bool = False
    sequence_parallel: bool = False
    # Context parallelism (CP): each packed row's tokens split over this many ranks of one data-parallel
    # replica, every sample cut into 2 x CP chunks and rank r holding chunks r and 2CP-1-r (causal load
    # balance); samples are padded to a multiple of 2 x CP, which the packer counts. DP = world / (TP x
    # PP x CP). Weights are not split: gradients are reduced over DP x CP.
    context_parallel_size: int = 1
    # How CP attention communicates: "auto" is megatron-core's p2p ring on the te layer backend and the
    # gathered keys and values (all_gather) on sdpa and flash; te also takes p2p, all_gather, a2a and
    # a2a+p2p (megatron-core's cp_comm_type); sdpa, flash and varlen take all_gather only.
    context_parallel_comm: str = "auto"
    # CP > 1: the row's images and videos are dealt among the CP ranks by modelled cost, each encodes
    # its share and the features are gathered (gradients return to the rank that encoded); off, every
    # CP rank encodes all of the row's media. With encoder_dp=tp the TP x CP ranks divide them; with
    # encoder_dp=full a step's media stay divided over TP x PP, each CP rank encoding its group's share.
    encoder_cp: bool = True
    # Mixture-of-experts layers: their experts are split over this many data-parallel ranks (expert
    # parallelism, EP; each holds num_experts / EP, tokens reach them by all-to-all), and each
    # expert's MLP over expert_tensor_parallel_size ranks (null = the language TP size).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # Data parallelism's levers (config.layout.data_parallel_settings decides; the run log and the dry
    # run say; docs/data_parallel.md). null = auto: on wherever gradients are reduced over more than one
    # rank (DP x CP > 1), off at DP x CP 1 where there is nothing to shard or overlap; a resume keeps the
    # checkpoint's kind of optimizer state. true or false as set wins.
    # use_distributed_optimizer: fp32 master weights and Adam moments sharded over DP x CP (megatron-core's
    # distributed optimizer); checkpoints save them resharded, so a run resumes at another DP size.
    use_distributed_optimizer: Optional[bool] = None
    # Each gradient bucket's reduction starts in the backward as soon as its last gradient is ready.
    overlap_grad_reduce: Optional[bool] = None
    # Distributed optimizer only, opt-in (null = off): each bucket's updated weights are all-gathered
    # during the next forward, in the forward pre-hook of the modules that own them, instead of all at
    # once after the update. Right only where every weight is read inside its own module's forward.
    overlap_param_gather: Optional[bool] = None
    # MoE with a shared expert at EP > 1: the shared expert computes on a side stream while the routed
    # tokens' all-to-all dispatch and combine run (megatron-core's moe_shared_expert_overlap; same sums,
    # so losses are unchanged: tests/models/test_ep_parity.py). On wherever it applies (a shared expert,
    # EP > 1, one router over all tokens, no clamped GLU); false keeps the shared expert after the combine.
    moe_shared_expert_overlap: bool = True
    # Launch size used by --dry-run and for deriving DP before processes exist.
    world_size: int = 1
    # Seconds a collective (and a stop-save after SIGTERM) may wait for the slowest rank before the
    # run fails naming the ranks that did not arrive. torch's 30 min keeps a hung job holding a
    # whole allocation for half an hour; a healthy step or checkpoint save is far below 10 min.
    collective_timeout_s: int = 600


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-5
    min_lr: float = 1e-6
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    # "cosine" or "constant" after warmup.
    decay_style: str = "cosine"


# The chunk the dry run and `loongforge bench loss` name (training.loss_chunk_tokens): at 4,096 tokens x 152k
# its step peaks at 0.16 of the row's fp32 logits, and a GEMM of 512 rows still runs at speed.
SUGGESTED_LOSS_CHUNK_TOKENS = 512


@dataclass
class TrainingConfig:
    train_steps: int = 1000
    # Stop (with a checkpoint) after this step without changing the LR schedule; null = run to the end.
    # For time-limited allocations: the next job resumes with --resume.
    exit_at_step: Optional[int] = None
    # Packed rows (of data.seq_len tokens each) per optimizer step over all data-parallel ranks.
    # One micro-batch is one packed row, as packed (THD) training runs; micro-batches per rank per
    # step = global_batch_size / DP. Preference training (``preference``): chosen/rejected pairs per
    # step, packed whole into as many rows as they take.
    global_batch_size: int = 8
    seed: int = 1234
    # "bf16" or "fp32"; on GPU the default bf16 is what users run.
    precision: str = "bf16"
    # FP8 GEMMs in the linear layers (CUDA compute capability 8.9+, bf16 runs; models.layers.fp8): "off";
    # "auto": the layer kinds that `loongforge bench gemm` measured at least 5% faster in FP8 at this
    # run's TP sizes and token counts, each in the recipe measured fastest (fp8.policy; without a
    # policy, bf16 everywhere); "on": every eligible linear in fp8.recipe. The LM head stays bf16.
    fp8: str = "off"
    # torch.compile of the blocks' small elementwise functions (RMSNorm, RoPE, SwiGLU, the MoE permute;
    # models.layers.compiled): "on", "off", or "auto": on with CUDA, off on the CPU, where compiling costs
    # ~10-30 CPU-s per function per process and runs no faster (docs/benchmarks/compile.md).
    compile: str = "auto"
    # "auto" picks cuda when available, else cpu.
    device: str = "auto"
    recompute_activations: bool = False
    # The LM head and its cross-entropy run this many loss tokens at a time (models.decoder.chunked_loss):
    # one chunk's fp32 logits exist at a time instead of the row's (at a 152k vocabulary, 9.9 GB for 16k
    # tokens), for the head's GEMM once more in the backward; the same loss and gradients. 0: the whole
    # row's logits at once (megatron-core's head), the default: chunked, the head's step measured 1.2-1.5x the
    # CPU time (docs/benchmarks/chunked_loss.md). SUGGESTED_LOSS_CHUNK_TOKENS where the logits do not fit.
    loss_chunk_tokens: int = 0
    freeze_vision: bool = False
    # Freeze the patch merger (the projector into the language model) as well: with freeze_vision,
    # the whole encoder is fixed, which is what training on stored embeddings (data.vision_embeddings) is.
    freeze_projector: bool = False
    # Freeze the language model (embeddings, decoder, LM head): a vision-language model's alignment
    # stage, which trains the projector (and the tower, unless frozen) through the fixed language model.
    freeze_language: bool = False
    # Python's garbage collector runs when allocation counts say so, at a different moment on every
    # rank; a pause mid-step makes that rank the straggler everyone waits for. With N > 0 automatic
    # collection is off and every rank collects after every N-th step, all at the same step.
    # 0 = Python's automatic collection.
    manual_gc_interval: int = 10
    # On SIGTERM (what schedulers send before preemption) every rank finishes the current step and
    # a checkpoint is saved before the run exits with 143, so --resume loses nothing. SIGINT
    # (Ctrl-C) stops at the step end without a new checkpoint. false: stop without saving.
    save_on_signal: bool = True
    # Validation (data.valid_paths, data.valid_fraction): evaluate every N steps and after the last
    # step; 0 = after the last step only. An evaluation runs each set's first eval_iters global
    # batches (the same rows every time, so the curve compares like with like) in eval mode,
    # without gradients, and leaves the training stream and RNG as they were.
    eval_interval: int = 0
    eval_iters: int = 10
    # Also evaluate before the first step (the starting model's validation loss, logged as step 0).
    eval_at_start: bool = False


@dataclass
class CheckpointConfig:
    # Folder for checkpoints; null = <output_dir>/checkpoints.
    dir: Optional[str] = None
    # Steps between saves; 0 = only at the end.
    save_interval: int = 0
    # Checkpoint folder to start from; --resume sets it to the latest in `dir`.
    load: Optional[str] = None
    # With `load`: take the checkpoint's weights alone and start a new training stage from step 0,
    # with a fresh optimizer, LR schedule and data position (resharded to this run's layout), e.g.
    # SFT after an alignment stage. --resume of this run then continues from its own checkpoints.
    weights_only: bool = False
    save_at_end: bool = True
    # HF folder (config.json + safetensors) to take the initial weights from, mapped at start-up
    # through the `loongforge convert` table: no separate conversion step. Unused when `load` or
    # --resume restores a checkpoint (that already holds the weights).
    load_hf: Optional[str] = None
    # Also write the final checkpoint as an HF folder, <output_dir>/hf (Hub key names, with the
    # config and tokenizer, processor and generation files of `load_hf` when it has them, else
    # written from this run's model and data settings), so a run's result serves in transformers.
    save_hf: bool = False


@dataclass
class LoggingConfig:
    output_dir: str = "runs/default"
    log_interval: int = 10
    tensorboard: bool = True
    progress_bar: bool = True
    # Dense peak TFLOP/s of one GPU for the run's dtype, the denominator of MFU; null = the table's
    # value for the device (loongforge.profile.throughput.PEAK_TFLOPS). On the CPU or a device the
    # table lacks, MFU is reported as n/a unless this is set.
    peak_tflops: Optional[float] = None
    # Show the known harmless third-party warnings (loongforge.parallel.console), once each;
    # `loongforge train --verbose` sets it.
    verbose: bool = False


@dataclass
class BalanceConfig:
    """Data-parallel load balancing: the compute-cost model (``loongforge fit-cost``)."""

    # COST.json from `loongforge fit-cost`; null = the checkpoint's model on resume, else fit online.
    cost_model: Optional[str] = None
    # Online fit when no cost_model is given: steps of per-rank timings to fit from (after
    # fit_warmup_steps); 0 = never fit. 20 steps x micro-batches x ranks is hundreds of points.
    fit_steps: int = 20
    # Steps recorded but not fitted at the start: the first steps pay for allocation and warm caches.
    fit_warmup_steps: int = 2
    # Refit every this many steps on the latest fit_steps steps (0 = fit once). Recording costs a
    # device synchronisation per micro-batch on GPU, so it is off unless asked for.
    refit_interval: int = 0
    # Re-assign each step's samples to DP ranks / micro-batches so every rank's modelled cost is
    # near the lower bound. The mode follows data.read: with global reading (or a packed manifest)
    # every rank plans from sizes it already has and nothing moves ("manifest" mode); with sharded
    # reading the ranks all-gather sizes and move samples with an all-to-all in the data thread
    # ("exchange" mode). The losses and gradients do not change: the loss is normalised by
    # global tokens.
    enabled: bool = False
    # Keep the arrival assignment when its max/LB - 1 is below this (planning would gain less).
    # Measured (docs/benchmarks/balance_rows.json): balanced plans sit within 0.2% of LB and
    # unbalanced steps 0.5-14% above it, so 1% skips only steps with little to gain.
    threshold: float = 0.01


@dataclass
class Fp8Config:
    # The policy file `loongforge bench gemm` writes, read with training.fp8=auto (it names each layer
    # kind's recipe).
    policy: Optional[str] = None
    # The FP8 GEMMs of training.fp8=on: "tensorwise" or "rowwise" (torchao's float8 training, the `fp8`
    # extra), "scaled_mm" (loongforge's own torch._scaled_mm GEMMs), "auto": tensorwise where torchao
    # imports, else scaled_mm.
    recipe: str = "auto"


@dataclass
class LoraConfig:
    """Low-rank adapters (models.layers.lora): y = W x + (alpha / rank) * B A dropout(x) on the chosen
    linears, as PEFT computes them; the base weights are frozen and only A and B train."""

    # Rank r of every adapter; 0: no adapters (full training).
    rank: int = 0
    # Scale numerator: the update is multiplied by alpha / rank (PEFT's default scaling).
    alpha: float = 16.0
    # Dropout on an adapter's input (its own, not the base linear's); 0: none.
    dropout: float = 0.0
    # Towers whose linears get adapters: language | vision | projector.
    targets: list[str] = field(default_factory=lambda: ["language"])
    # Linears within a block: qkv (attention q/k/v), proj (attention output), fc1 (MLP in; gate and
    # up with SwiGLU), fc2 (MLP out). PEFT's q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj.
    modules: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    # Mixture-of-experts layers: adapters on every expert's fc1/fc2 too (the router is never adapted).
    experts: bool = False


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Preference training (DPO, IPO, hinge, SimPO, ORPO on chosen/rejected pairs; config.preference);
    # null: SFT.
    preference: Optional[PreferenceConfig] = None
    # Name of the preset this config was composed from (informational).
    preset: Optional[str] = None
