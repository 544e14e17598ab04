"""The settings of every config section a step reads, one frozen dataclass each.

These are the one source of each key's default, choices and help: the step's
``--flags`` (with the same defaults, listed by ``--help``), the rule's command
line (:func:`snakellm.config.settings.to_flags` in ``rules/common.smk``) and the
``trajectory`` keys derive from them, and tests/test_settings.py checks that
``config/schema.yaml`` has exactly these keys, defaults, enums and required keys.
The schema keeps what a dataclass cannot say (minimum, pattern, descriptions of
whole sections). The architecture keys are :class:`snakellm.models.ModelSettings`.

``trajectory``: changing the setting makes old checkpoints a different training
run (the batch size, the schedule, the seed ...). Only these enter the settings
fingerprint stored with checkpoints; everything else (intervals, keep_last,
max_time, workers, logging) may change between restarts.

Fields that are not flags (``cli=False``) are read by the workflow itself: job
resources (``threads``), what the default target holds (``enabled``), planning
(``sources``, ``chunks``) or paths the rule spells out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snakellm.config.settings import REQUIRED, setting
from snakellm.models.architecture import ModelSettings

# the built-in chat templates (snakellm.finetune.chat_template.BUILTIN; a test keeps the two equal): a
# fine-tune's chat_template names one of them or a file
CHAT_TEMPLATE_NAMES = ("chatml", "llama3", "mistral")
PACKED_ATTENTION = ("dense", "flex", "varlen")  # snakellm.models.attention: a bool mask, or segment ids (flex, varlen)
PACKING_ONLY = ("packing", "packed_attention")  # example settings of training only (evaluation never packs)

SOURCE_FORMATS = ("jsonl", "jsonl.zst", "jsonl.gz", "text", "text-blocks", "mediawiki", "parquet", "arrow", "warc")
COLUMNAR_FORMATS = ("parquet", "arrow")  # read by snakellm.data.columnar: `id_key`, `columns`
TOKENIZER_KINDS = ("gpt2-bpe", "sentencepiece", "huggingface")
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_INITS = ("xavier", "normal", "kaiming", "zero")
PRECISIONS = ("auto", "bf16", "fp32", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
DECAY_STYLES = ("cosine", "linear", "constant")

# ---------------------------------------------------------------- data: sources, download


# ---------------------------------------------------------------- data: curation (docs/data.md#curation)

CURATE_FILTERS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")  # the order they are applied in
LANGUAGE_MODELS = ("pycld2", "py3langid")
MINHASH_SCHEMES = ("snakellm", "datatrove")


@dataclass(frozen=True, kw_only=True)
class NearDupSettings:
    """``sources.<name>.curate.near``: MinHash near-duplicate removal (LSH over ``bands`` x ``rows`` values)."""

    threshold: float = setting(
        0.8,
        "a candidate pair (one equal band) is a duplicate when its MinHash-estimated Jaccard similarity is at least "
        "this (0: every candidate pair is, as datatrove does)",
    )
    ngram: int = setting(5, "words per shingle (after datatrove's normalisation)")
    bands: int = setting(14, "LSH bands (datatrove: 14; NeMo Curator: 20)")
    rows: int = setting(8, "MinHash values per band (datatrove: 8; NeMo Curator: 13)")
    seed: int = setting(1, "seed of the MinHash permutations")
    scheme: str = setting(
        "snakellm",
        "snakellm: our shingle hashes and rensa's permutations, each cluster keeps its first document; datatrove: "
        "datatrove 0.10's exact signatures (64-bit) and its union-find's kept document (with threshold 0: its "
        "removed set)",
        choices=MINHASH_SCHEMES,
    )
    index_jobs: int = setting(
        1,
        "bucket jobs; past bands + 1 each band is split into hash slices (a job holds ~32 B x documents / slices)",
        cli=False,
    )


@dataclass(frozen=True, kw_only=True)
class GopherQualitySettings:
    """``...filters.gopher_quality``: datatrove's GopherQualityFilter (Gopher, Rae et al. 2021, A.1.1)."""

    min_doc_words: int | None = setting(50, "fewer words: gopher_short_doc")
    max_doc_words: int | None = setting(100000, "more words: gopher_long_doc")
    min_avg_word_length: float | None = setting(3, "shorter mean word length: gopher_below_avg_threshold")
    max_avg_word_length: float | None = setting(10, "longer mean word length: gopher_above_avg_threshold")
    max_symbol_word_ratio: float | None = setting(0.1, "more # and ... per word: gopher_too_many_hashes/ellipsis")
    max_bullet_lines_ratio: float | None = setting(0.9, "more lines starting with a bullet: gopher_too_many_bullets")
    max_ellipsis_lines_ratio: float | None = setting(
        0.3, "more lines ending in an ellipsis: gopher_too_many_end_ellipsis"
    )
    max_non_alpha_words_ratio: float | None = setting(
        0.8, "the least share of words with a letter: gopher_below_alpha_threshold"
    )
    min_stop_words: int | None = setting(2, "fewer stop words: gopher_enough_stop_words")
    stop_words: list[str] | None = setting(
        None, "the stop words (default: Gopher's the, be, to, of, and, that, have, with)"
    )


@dataclass(frozen=True, kw_only=True)
class GopherRepetitionSettings:
    """``...filters.gopher_repetition``: datatrove's GopherRepetitionFilter (Gopher's repetition removal)."""

    dup_line_frac: float | None = setting(0.3, "share of duplicated lines: dup_line_frac")
    dup_para_frac: float | None = setting(0.3, "share of duplicated paragraphs: dup_para_frac")
    dup_line_char_frac: float | None = setting(0.2, "share of characters in duplicated lines: dup_line_char_frac")
    dup_para_char_frac: float | None = setting(0.2, "share of characters in duplicated paragraphs: dup_para_char_frac")
    top_n_grams: list[list[float]] = setting(
        [[2, 0.2], [3, 0.18], [4, 0.16]], "[n, share]: characters in the most frequent n-gram: top_n_gram"
    )
    dup_n_grams: list[list[float]] = setting(
        [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11], [10, 0.10]],
        "[n, share]: characters in duplicated n-grams: duplicated_n_grams",
    )


@dataclass(frozen=True, kw_only=True)
class C4Settings:
    """``...filters.c4``: datatrove's C4QualityFilter, as a verdict only (a kept document's text is never changed)."""

    split_paragraph: bool = setting(True, "lines are the text's lines (false: sentences)")
    remove_citations: bool = setting(True, "drop [1]-style citations before the line rules")
    filter_no_terminal_punct: bool = setting(True, "a line without terminal punctuation does not count")
    min_num_sentences: int = setting(5, "fewer sentences in counted lines: too_few_sentences (-1: off)")
    min_words_per_line: int = setting(3, "a shorter line does not count (-1: off)")
    max_word_length: int = setting(1000, "a line with a longer word does not count (-1: off)")
    filter_lorem_ipsum: bool = setting(True, "'lorem ipsum': lorem_ipsum")
    filter_javascript: bool = setting(True, "a line naming javascript does not count")
    filter_curly_bracket: bool = setting(True, "a '{' in a counted line: curly_bracket")
    filter_policy: bool = setting(True, "a line with a policy phrase (cookie, terms of use ...) does not count")


@dataclass(frozen=True, kw_only=True)
class FineWebSettings:
    """``...filters.fineweb``: datatrove's FineWebQualityFilter (the FineWeb paper's three rules)."""

    line_punct_thr: float = setting(0.12, "least share of lines ending in punctuation: line_punct_ratio")
    line_punct_exclude_zero: bool = setting(False, "a document with no such line passes that rule")
    stop_chars: list[str] | None = setting(None, "what counts as ending punctuation (default: datatrove's set)")
    short_line_thr: float = setting(0.67, "most share of short lines: short_line_ratio")
    short_line_length: int = setting(30, "a line shorter than this many characters is short")
    char_duplicates_ratio: float = setting(0.01, "most share of characters in duplicated lines: char_dup_ratio")
    new_line_ratio: float = setting(0.3, "most newlines per word: list_ratio")


@dataclass(frozen=True, kw_only=True)
class CurateFiltersSettings:
    """``sources.<name>.curate.filters``: quality filters by name; a filter is on when its key is there (``{}``: its
    defaults). They run in the order gopher_repetition, gopher_quality, c4, fineweb; the first rule a document fails
    is its reason."""

    gopher_repetition: dict[str, Any] | None = setting(
        None, "Gopher repetition rules", section=GopherRepetitionSettings
    )
    gopher_quality: dict[str, Any] | None = setting(None, "Gopher quality rules", section=GopherQualitySettings)
    c4: dict[str, Any] | None = setting(None, "C4's document rules", section=C4Settings)
    fineweb: dict[str, Any] | None = setting(None, "FineWeb's rules", section=FineWebSettings)


@dataclass(frozen=True, kw_only=True)
class CurateSettings:
    """``sources.<name>.curate``: what is removed before tokenization (data/curated/{source}/{chunk}.jsonl)."""

    exact: bool = setting(True, "remove exact duplicates (same text after NFC and whitespace normalisation)")
    near: dict[str, Any] | None = setting(None, "MinHash near-duplicate removal (absent: off)", section=NearDupSettings)
    filters: dict[str, Any] = setting({}, "quality filters by name", section=CurateFiltersSettings)
    languages: list[str] | None = setting(
        None, "keep only documents identified as one of these ISO 639-1 languages (absent: no language ID)"
    )
    language_threshold: float = setting(0.5, "a lower language-ID confidence is rejected too (language_id)")
    language_model: str = setting(
        "pycld2", "the language identifier (its model ships inside the package)", choices=LANGUAGE_MODELS
    )
    index: str | None = setting(
        None, "the duplicate index: sources naming the same index are deduplicated together (default: the source's own)"
    )


@dataclass(frozen=True, kw_only=True)
class SourceSettings:
    """``sources.<name>``: one corpus; its shards are sorted naturally and sliced into chunks."""

    kind: str = setting(REQUIRED, "local files or http URLs", choices=("local", "http"), cli=False)
    path: str | list[str] | None = setting(None, "glob(s) of local shard files; `**` recurses", cli=False, path="glob")
    url: str | list[str] | None = setting(None, "URL template(s) with shell-style braces", cli=False)
    urls: list[str] | None = setting(None, "explicit URLs (added to those from `url`)", cli=False)
    format: str = setting(
        REQUIRED,
        "shard format (compression is taken from each shard's magic bytes)",
        choices=SOURCE_FORMATS,
        cli_default="jsonl",
    )
    key: str = setting("text", "JSON key (parquet, arrow: column) holding the document text")
    id_key: str = setting("id", "parquet, arrow: column of the document id (a file without it: `{shard}/{row}`)")
    columns: list[str] | None = setting(
        None, "parquet, arrow: the other columns kept in each record (default: all of them)"
    )
    token_env: str | None = setting(
        None, "http: environment variable of a bearer token sent to the URLs' own host only (HF_TOKEN)", cli=False
    )
    weight: float = setting(1.0, "sampling weight in the blend (multiplied by the source's token count)", cli=False)
    shards_per_chunk: int | None = setting(
        None, "shards concatenated into one chunk (one job per chunk); this or row_groups_per_chunk", cli=False
    )
    row_groups_per_chunk: int | None = setting(
        None,
        "local parquet: each file sliced into chunks of up to N of its row groups (planned from footers)",
        cli=False,
    )
    # flags of `snakellm chunk` whose command-line default is "no limit" (steps/chunk.py); the rule passes these
    max_document_bytes: int = setting(
        67108864, "a longer document is quarantined as too_long, never held whole in memory", cli=False
    )
    max_rejected_fraction: float = setting(
        0.5, "a shard of at least 10 lines with a larger share rejected fails its chunk job (1: off)", cli=False
    )
    curate: dict[str, Any] | None = setting(None, "deduplication, filters, language ID", section=CurateSettings)


@dataclass(frozen=True, kw_only=True)
class DownloadSettings:
    """``download``: retries and transfers of `snakellm download` (http sources)."""

    concurrency: int = setting(8, "parallel requests per download job")
    retries: int = setting(
        8, "consecutive failed attempts without new bytes allowed per shard (429, 408, 5xx); a 404 fails at once"
    )
    backoff_s: float = setting(1.0, "first retry delay in seconds; doubles each time", flag="backoff")
    max_backoff_s: float = setting(60.0, "cap on one retry delay (and on Retry-After), seconds", flag="max_backoff")
    timeout_s: float = setting(60.0, "connect/read timeout per request, seconds", flag="timeout")
    deadline_s: float = setting(
        7200.0, "a shard not complete this long after its first request fails its job (0: no deadline)", flag="deadline"
    )
    min_rate_bytes_s: float = setting(
        1024.0,
        "bytes/s an attempt must average over each timeout_s window, else it ends and counts as a failure (0: none)",
        flag="min_rate",
    )


# ---------------------------------------------------------------- tokenize stage


@dataclass(frozen=True, kw_only=True)
class SampleSettings:
    """``tokenizers.<name>.train.sample``: the deterministic sample a SentencePiece model is trained on."""

    sources: list[str] | None = setting(None, "sources to sample (default: all)", cli=False)
    chunks: int = setting(1, "the first N chunks of each source (0: all chunks)", cli=False)
    max_bytes: int = setting(100_000_000, "about this much text at most (0: no cap)")
    seed: int = setting(0, "seed of the document sample")


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainSettings:
    """``tokenizers.<name>.train``: SentencePiece training (`snakellm train-tokenizer`)."""

    model_type: str = setting("bpe", "SentencePiece model type", choices=("bpe", "unigram", "char", "word"))
    character_coverage: float = setting(1.0, "share of characters covered by the vocabulary")
    normalization: str = setting(
        "preserve",
        "preserve: the text as it is, as Llama's and Gemma's models (identity normalization, whitespace runs and "
        "newlines kept, digits split, byte fallback); sentencepiece: SentencePiece's own defaults (nmt_nfkc, "
        "extra whitespace removed: newlines lost)",
        choices=("preserve", "sentencepiece"),
    )
    byte_fallback: bool | None = setting(
        None,
        "decompose unknown characters into UTF-8 byte pieces instead of <unk> (unset: the normalization's, "
        "preserve: true, sentencepiece: false)",
    )
    user_defined_symbols: list[str] = setting(
        [], "a piece that is never split (e.g. a special marker)", flag="user_defined_symbol"
    )
    max_sentence_length: int = setting(16384, "longest training line in bytes (longer lines are skipped)")
    threads: int = setting(2, "training threads; a setting because unigram models depend on it")
    options: dict[str, Any] = setting({}, "any other SentencePieceTrainer option", flag="option")
    sample: dict[str, Any] = setting({}, "the training sample", section=SampleSettings)


@dataclass(frozen=True, kw_only=True)
class TokenizerSettings:
    """``tokenizers.<name>``: how `snakellm tokenize` loads a tokenizer."""

    kind: str = setting(REQUIRED, "tokenizer kind", choices=TOKENIZER_KINDS)
    vocab_file: str | None = setting(None, "gpt2-bpe: vocab.json (Megatron --vocab-file)", path="file")
    merges_file: str | None = setting(None, "gpt2-bpe: merges.txt (Megatron --merge-file)", path="file")
    model_file: str | None = setting(None, "sentencepiece: the .model file", path="file")
    tokenizer_file: str | None = setting(None, "huggingface: a tokenizer.json", path="file")
    eod: str | None = setting(
        None,
        "end-of-document token appended to every document (gpt2-bpe: <|endoftext|>; sentencepiece: the model's "
        "eos piece; huggingface: required)",
    )
    vocab_size: int | None = setting(None, "the configured vocab size: a tokenizer of another size is an error")
    add_special_tokens: bool | None = setting(None, "huggingface: apply the post-processor's special tokens")
    train: dict[str, Any] | None = setting(None, "train this SentencePiece model", section=TokenizerTrainSettings)


@dataclass(frozen=True, kw_only=True)
class TokenizeSettings:
    """``tokenize``: which tokenizers the default target builds, and the threads of each job."""

    tokenizers: list[str] | None = setting(None, "tokenizers the default target builds (default: all)", cli=False)
    threads: int = setting(2, "encoder threads per tokenize job", cli=False)


# ---------------------------------------------------------------- runs, launch


@dataclass(frozen=True, kw_only=True)
class ResumeSettings:
    """What a restarted job does with the checkpoints it finds: the same two settings for every training job
    (``runs.<name>.train`` and ``snakellm finetune``), read by :mod:`snakellm.train.resume`."""

    resume: str = setting(
        "auto",
        "auto: from the latest checkpoint if any; require: fail without one; never: move "
        "checkpoints aside and start fresh",
        choices=("auto", "require", "never"),
    )
    on_config_change: str = setting(
        "archive",
        "checkpoints made with other trajectory settings: move them to checkpoints.old-<time>/ and "
        "start fresh (archive), or fail (error)",
        choices=("archive", "error"),
    )


@dataclass(frozen=True)
class TrainSettings(ResumeSettings):
    """``runs.<name>.train``: steps, batch, optimizer, schedule, checkpoints, stopping."""

    steps: int = setting(REQUIRED, "optimizer steps (iterations) in total")
    micro_batch_size: int = setting(REQUIRED, "sequences per rank per forward pass")
    global_batch_size: int = setting(
        REQUIRED, "sequences per step: micro batch x data-parallel size x gradient accumulation steps", trajectory=True
    )
    lr: float = setting(6.0e-4, "peak learning rate (AdamW)", trajectory=True)
    min_lr: float = setting(6.0e-5, "learning rate at the end of the decay", trajectory=True)
    warmup_steps: int = setting(0, "linear warmup steps", trajectory=True)
    decay_steps: int | None = setting(
        None,
        "step at which min-lr is reached (default: --steps); set it to extend a run later without changing "
        "its schedule",
        trajectory=True,
    )
    lr_decay_style: str = setting(
        "cosine", "learning-rate decay after warmup", trajectory=True, choices=("cosine", "linear", "constant")
    )
    weight_decay: float = setting(0.1, "decoupled weight decay (not on biases and norms)", trajectory=True)
    adam_beta1: float = setting(0.9, "AdamW beta1", trajectory=True)
    adam_beta2: float = setting(0.95, "AdamW beta2", trajectory=True)
    adam_eps: float = setting(1.0e-8, "AdamW epsilon", trajectory=True)
    clip_grad: float = setting(1.0, "gradient-norm clip (0: off)", trajectory=True)
    seed: int = setting(1234, "seeds the weights, the data order and dropout", trajectory=True)
    split: str = setting(
        "969,30,1", "train,valid,test shares of each token file's documents (Megatron --split)", trajectory=True
    )
    precision: str = setting(
        "auto",
        "auto: bf16 with fp32 master weights on GPU, fp32 on CPU; fp8: bf16 weights with the transformer "
        "blocks' matmuls in float8 (GPUs of compute capability 8.9+: Ada, Hopper)",
        trajectory=True,
        choices=PRECISIONS,
    )
    fp8_recipe: str = setting(
        "tensorwise",
        "precision fp8: one scale per tensor (tensorwise) or per row (rowwise) for the float8 casts (enters the "
        "trajectory only with fp8)",
        trajectory=True,
        choices=FP8_RECIPES,
    )
    save_interval: int = setting(1000, "checkpoint every N steps (and at the end)")
    keep_last: int = setting(2, "keep the newest K checkpoints, plus the best by validation loss")
    async_save: bool = setting(
        False,
        "write checkpoints in the background (megatron-core's asynchronous torch_dist save: the states are "
        "copied to host memory, a forked process writes them while training goes on; published when complete)",
    )
    eval_interval: int = setting(1000, "validation loss every N steps (and at every checkpoint)")
    eval_iters: int = setting(10, "validation batches per evaluation (0: none)")
    log_interval: int = setting(10, "metrics are fetched from the device and written every N steps")
    max_time: str | float | None = setting(
        None, "stop cleanly (checkpoint, exit status 75) after this long: seconds, 90m, 2h, HH:MM:SS, D-HH:MM:SS"
    )
    collective_timeout: float = setting(
        600.0,
        "seconds a rank may make no progress before it ends the job, naming the rank(s) it waits for "
        "(snakellm.launch.watchdog); the process group's own timeout is 60 s longer",
    )
    retries: int | None = setting(
        None,
        "attempts Snakemake adds after a failed or stopped (exit 75) attempt, each resuming from the latest "
        "checkpoint (null: the profile's `retries`)",
        cli=False,
    )


# pretraining's and fine-tuning's parallel.grad_reduce_dtype
GRAD_REDUCE_HELP = (
    "the dtype the data-parallel gradient reduction of bf16 (and fp8) training communicates in: fp32 (megatron-core's "
    "grad_reduce_in_fp32, torchtitan's default) or bf16 (half the bytes, as NeMo's performance recipes set it). "
    "With fsdp the reduced gradients still accumulate into fp32 shards; megatron-core DDP keeps bf16 gradient "
    "buffers, so its micro-batches also accumulate in bf16. Needs precision bf16 or fp8"
)


@dataclass(frozen=True)
class ParallelSettings:
    """``runs.<name>.parallel``: how the ranks split the model and the work."""

    tp: int = setting(1, "tensor-parallel size (on the CPU only for models without dropout)")
    pp: int = setting(
        1,
        "pipeline-parallel size: the layers split into pp stages, run by megatron-core's 1F1B schedule "
        "(num_layers divisible by pp x virtual_pp)",
    )
    virtual_pp: int = setting(
        1,
        "virtual pipeline stages (model chunks) per pipeline rank: megatron-core's interleaved 1F1B schedule, a "
        "smaller pipeline bubble for more point-to-point traffic (> 1 needs pp > 1 and micro batches per step "
        "divisible by pp)",
    )
    ep: int = setting(
        1,
        "expert-parallel size (mixture of experts): each layer's experts split over ep of the data-parallel ranks, "
        "tokens exchanged by megatron-core's alltoall dispatcher (num_experts divisible by ep; ep divides the "
        "data-parallel size)",
    )
    moe_experts: str = setting(
        "grouped",
        "mixture of experts without Transformer Engine: grouped (each layer's local experts as two grouped matrix "
        "products, torch._grouped_mm) or sequential (megatron-core's SequentialMLP, one matmul per expert); the "
        "same parameters and checkpoints",
        choices=("grouped", "sequential"),
    )
    recompute: str = setting(
        "none",
        "megatron-core activation recomputation: selective (core attention, recomputed in the backward pass) or "
        "full (whole transformer layers: only each layer's input is kept)",
        choices=("none", "selective", "full"),
    )
    recompute_method: str = setting(
        "uniform",
        "recompute full: uniform (the layers in groups of recompute_num_layers, each group's input kept) or block "
        "(the first recompute_num_layers layers of each pipeline stage or chunk, the rest kept whole)",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int = setting(
        1, "recompute full: layers per group (uniform) or recomputed layers per stage or chunk (block)"
    )
    threads: int = setting(2, "CPU threads of the job (torch intra-op threads on CPU)")
    num_workers: int | None = setting(None, "data-loader workers per rank (null: 2 on GPU, 0 on CPU)")
    loss: str = setting(
        "auto",
        "cross-entropy: compiled (fused, vocabulary-parallel at tp > 1; GPU default), eager (the same "
        "uncompiled; CPU default), or megatron-core's vocab-parallel one",
        choices=("auto", "compiled", "eager", "megatron"),
    )
    compile: bool = setting(False, "torch.compile each transformer layer (GPU)")
    sequence_parallel: bool = setting(
        False,
        "megatron-core sequence parallelism: the norms, dropouts, embedding output and residual stream are split "
        "along the sequence over the tensor-parallel ranks instead of replicated (needs tp > 1)",
    )
    distributed_optimizer: bool = setting(
        False,
        "shard the fp32 Adam states and master weights over the data-parallel ranks (megatron-core's "
        "distributed-optimizer gradient buffers: reduce-scatter, then all-gather of the updated weights)",
    )
    overlap_param_gather: bool = setting(
        False,
        "with distributed_optimizer: the updated weights are all-gathered bucket by bucket just before the next "
        "forward pass uses them, overlapped with its compute (megatron-core DDP's forward pre-hooks), instead of "
        "all at once after the optimizer step",
    )
    fsdp: bool = setting(
        False,
        "shard the parameters and gradients as well as the optimizer states over the data-parallel ranks "
        "(PyTorch FSDP2, ZeRO-3: each layer's weights gathered just before it runs; 16 bytes a parameter "
        "become 16 / dp); checkpoints keep their layout",
    )
    fp8_all_gather: bool = setting(
        False,
        "with fsdp and precision fp8 (tensorwise): FSDP all-gathers the block linears' weights in float8, each "
        "rank casting its own fp32 shard with scales from one all-reduce of the weights' amaxes after each step "
        "(torchao's float8 all-gather, as torchtitan's enable_fsdp_float8_all_gather): half the gathered bytes, "
        "and no cast of every whole weight in each forward and backward",
    )
    grad_reduce_dtype: str = setting("fp32", GRAD_REDUCE_HELP, choices=("fp32", "bf16"))


@dataclass(frozen=True, kw_only=True)
class ContainerSettings:
    """``container``: the container the training ranks run in (read by snakellm.launch.prefix)."""

    runtime: str = setting("none", "container runtime", choices=("none", "pyxis", "apptainer"), cli=False)
    image: str | None = setting(None, "an enroot URI or .sqsh (pyxis), a .sif or docker:// URI (apptainer)", cli=False)
    mounts: list[str] = setting([], "SRC[:DST[:FLAGS]] bind mounts", cli=False)


@dataclass(frozen=True, kw_only=True)
class JobResourceSettings:
    """The allocation of a GPU stage's jobs (``runs.<name>.resources``, ``finetune.<name>.resources``,
    ``resources.<stage>``); read by :mod:`snakellm.config.jobs`, which turns it into the rule's resources.

    Every key defaults to unset: a run's own value wins over the workflow's ``resources.<stage>``,
    that over the site's environment (the Slurm profile's variables), that over the built-in default
    (:data:`snakellm.config.jobs.BUILTIN`). Nothing here is a flag of a step, and none of it enters a
    fingerprint: moving a run to more GPUs resumes it (the batch stays the same).
    """

    nodes: int | None = setting(None, "nodes of the job", cli=False)
    gpus_per_node: int | None = setting(None, "GPUs per node = ranks per node (0: a CPU job)", cli=False)
    cpus_per_gpu: int | None = setting(None, "CPUs per rank (unset: the job's threads)", cli=False)
    mem_mb: int | None = setting(None, "memory per node in MB (unset or 0: the cluster's default)", cli=False)
    time_limit: int | str | None = setting(
        None, "the job's time limit: minutes, or [D-]HH:MM[:SS] (a stopped training job resumes)", cli=False
    )
    signal_s: int | None = setting(
        None,
        "multi-rank jobs: SIGUSR1 to the ranks this long before the limit (checkpoint, exit 75; 0: none)",
        cli=False,
    )
    partition: str | None = setting(None, "Slurm partition (sbatch -p)", cli=False)
    account: str | None = setting(None, "Slurm account (sbatch -A)", cli=False)
    qos: str | None = setting(None, "Slurm quality of service (sbatch --qos)", cli=False)
    constraint: str | None = setting(None, "node features (sbatch -C)", cli=False)
    sbatch_extra: str | None = setting(
        None, "further sbatch flags (those Snakemake's Slurm plugin sets itself are rejected by it)", cli=False
    )
    container: dict[str, Any] | None = setting(
        None, "the job's container (replaces the workflow's `container` block)", section=ContainerSettings
    )


@dataclass(frozen=True, kw_only=True)
class ResourcesSettings:
    """``resources``: the workflow's defaults for each GPU stage's jobs (a run or fine-tune may set its own)."""

    pretrain: dict[str, Any] = setting({}, "pretraining runs", section=JobResourceSettings)
    finetune: dict[str, Any] = setting({}, "fine-tunes", section=JobResourceSettings)
    evaluate: dict[str, Any] = setting({}, "evaluation (one GPU)", section=JobResourceSettings)
    generate: dict[str, Any] = setting({}, "samples (one GPU)", section=JobResourceSettings)
    convert: dict[str, Any] = setting(
        {},
        "exports and imports (.nemo, Hugging Face, PEFT, merged LoRA; a CPU job by default)",
        section=JobResourceSettings,
    )


# ---------------------------------------------------------------- experiment tracking (docs/tracking.md)

WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True, kw_only=True)
class WandbSettings:
    """``tracking.wandb``: a Weights & Biases run per job (the key only from WANDB_API_KEY; files under WANDB_DIR)."""

    project: str | None = setting(None, "the W&B project (unset: no W&B run)", flag="wandb_project")
    entity: str | None = setting(None, "the W&B team or user (unset: the API key's default)", flag="wandb_entity")
    mode: str | None = setting(
        None,
        "online: stream to the server; offline: files only, upload later with `wandb sync`; disabled: no run "
        "(unset: WANDB_MODE, else online)",
        choices=WANDB_MODES,
        flag="wandb_mode",
    )
    group: str | None = setting(None, "the W&B group of the run", flag="wandb_group")
    tags: list[str] | None = setting(None, "W&B tags of the run", flag="wandb_tag")


@dataclass(frozen=True, kw_only=True)
class MlflowSettings:
    """``tracking.mlflow``: an MLflow run per job (the token only from MLFLOW_TRACKING_TOKEN and MLflow's variables)."""

    tracking_uri: str | None = setting(
        None,
        "the MLflow tracking server or store (unset: MLFLOW_TRACKING_URI; with neither this nor experiment: no MLflow run)",
        flag="mlflow_tracking_uri",
    )
    experiment: str | None = setting(
        None, "the MLflow experiment (created if missing; unset: Default)", flag="mlflow_experiment"
    )
    tags: dict[str, str] | None = setting(None, "MLflow tags of the run", flag="mlflow_tag")


@dataclass(frozen=True, kw_only=True)
class TrackingSettings:
    """``tracking`` (and ``runs.<name>.tracking``, ``finetune.<name>.tracking``, which override the keys they set)."""

    wandb: dict[str, Any] = setting({}, "Weights & Biases", section=WandbSettings)
    mlflow: dict[str, Any] = setting({}, "MLflow", section=MlflowSettings)


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """``runs.<name>``: one pretraining run."""

    tokenizer: str = setting(REQUIRED, "a key of `tokenizers`", cli=False)
    model: dict[str, Any] = setting({"preset": "tiny"}, "a preset, then single keys", section=ModelSettings)
    train: dict[str, Any] = setting(REQUIRED, "steps, batch, optimizer, checkpoints", section=TrainSettings)
    parallel: dict[str, Any] = setting({}, "how the ranks split the work", section=ParallelSettings)
    resources: dict[str, Any] = setting({}, "the job's allocation", section=JobResourceSettings)
    tracking: dict[str, Any] = setting({}, "W&B and MLflow, over the global tracking", section=TrackingSettings)


# ---------------------------------------------------------------- fine-tuning stage


@dataclass(frozen=True, kw_only=True)
class SftDataSettings:
    """``sft_data.<name>``: `snakellm prepare-sft` of one data set."""

    path: str = setting(REQUIRED, "a SQuAD-format .json or a .jsonl file", cli=False, path="file")
    format: str = setting(
        "squad",
        "squad: answerable questions, first answer as output; jsonl: records with input_key/output_key; "
        "messages: OpenAI-style {role, content} lists; sharegpt: {from, value} lists (human, gpt, system); "
        "preference: {prompt, chosen, rejected} strings (TRL's explicit-prompt form), for method dpo",
        choices=("squad", "jsonl", "messages", "sharegpt", "preference"),
    )
    template: str | None = setting(
        None,
        "prompt of each record; squad fields {context} {question} {title} (default 'Context: {context} "
        "Question: {question} Answer:'), jsonl: the record's string fields (default the input key as is)",
    )
    input_key: str = setting("input", "jsonl: key of the prompt")
    output_key: str = setting("output", "jsonl: key of the answer (a string or a list of gold answers)")
    messages_key: str | None = setting(
        None, "messages/sharegpt: key of the conversation list (null: messages, or conversations for sharegpt)"
    )
    split: str = setting("80,10,10", "train,validation,test shares after a seeded shuffle")
    seed: int = setting(1234, "seed of the shuffle before splitting")
    limit: int | None = setting(None, "use only this many records (after the shuffle)")


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """``finetune.<name>.lora``: NeMo's peft lora_tuning options."""

    rank: int = setting(32, "adapter_dim", trajectory=True, flag="lora_rank")
    alpha: float | None = setting(None, "scale = alpha / rank (null: alpha = rank)", trajectory=True, flag="lora_alpha")
    dropout: float = setting(0.0, "adapter_dropout", trajectory=True, flag="lora_dropout")
    targets: list[str] = setting(
        ["linear_qkv"], "target_modules (megatron-core linears)", trajectory=True, flag="lora_targets", sep=","
    )
    layers: list[int] | None = setting(
        None, "1-based layer_selection (null: all)", trajectory=True, flag="lora_layers", sep=",", parse=int
    )
    column_init: str = setting(
        "xavier", "init of A (linear_in)", trajectory=True, choices=LORA_INITS, flag="lora_column_init"
    )
    row_init: str = setting("zero", "init of B (linear_out)", trajectory=True, choices=LORA_INITS, flag="lora_row_init")
    modules_to_save: list[str] = setting(
        [],
        "base modules trained whole beside the adapters and saved with them (PEFT's modules_to_save)",
        trajectory=True,
        flag="lora_modules_to_save",
        sep=",",
    )


@dataclass(frozen=True, kw_only=True)
class PtuningSettings:
    """``finetune.<name>.ptuning``: virtual tokens from a prompt encoder."""

    virtual_tokens: int = setting(10, "virtual tokens before every example", trajectory=True)
    encoder: str = setting("mlp", "prompt encoder", trajectory=True, choices=("mlp", "lstm"), flag="prompt_encoder")
    hidden: int = setting(2048, "prompt encoder hidden size", trajectory=True, flag="prompt_encoder_hidden")


DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# the settings of a DPO fine-tune that decide the pairs' tokens (and so the reference's log-probabilities)
DPO_TOKENIZATION = ("max_length", "max_prompt_length", "truncation_mode")


@dataclass(frozen=True, kw_only=True)
class DpoSettings:
    """``finetune.<name>.dpo``: preference tuning (method dpo), by the definitions of TRL's ``DPOTrainer``."""

    policy: str = setting(
        "lora",
        "what trains: LoRA adapters (the lora block) or every weight",
        trajectory=True,
        choices=("lora", "full"),
        flag="dpo_policy",
    )
    beta: float = setting(0.1, "deviation from the reference (IPO: its tau)", trajectory=True, flag="dpo_beta")
    loss: str = setting(
        "sigmoid",
        "sigmoid (DPO), ipo (length-normalised), hinge (SLiC), robust (label_smoothing: the flip rate), simpo "
        "(reference-free, length-normalised, margin simpo_gamma; TRL's CPOTrainer with cpo_alpha 0)",
        trajectory=True,
        choices=DPO_LOSSES,
        flag="dpo_loss",
    )
    label_smoothing: float = setting(
        0.0,
        "robust: the probability a label is flipped, in [0, 0.5); simpo: CPO's conservative smoothing",
        trajectory=True,
        flag="dpo_label_smoothing",
    )
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin", trajectory=True, flag="dpo_simpo_gamma")
    reference: str = setting(
        "base",
        "the frozen reference: base (the fine-tune's starting model: its start, else its run), a key of runs or import_hf, a full fine-tune's name "
        "(its model) or a LoRA fine-tune's (its base plus its adapter), or adapter-off (policy lora: the base with the adapters off, computed in-process)",
        trajectory=True,
        flag="dpo_reference",
    )
    max_length: int | None = setting(
        None,
        "prompt + completion tokens at most (null: the model's seq_length)",
        trajectory=True,
        flag="dpo_max_length",
    )
    max_prompt_length: int | None = setting(
        None,
        "prompt tokens at most, cut before max_length by truncation_mode (null: off)",
        trajectory=True,
        flag="dpo_max_prompt_length",
    )
    truncation_mode: str = setting(
        "keep_start",
        "what a too long pair keeps (TRL's truncation_mode): its start (a pair whose prompt fills max_length is "
        "dropped and counted) or its end; a too long prompt keeps its end under keep_end, its start under keep_start",
        trajectory=True,
        choices=("keep_start", "keep_end"),
        flag="dpo_truncation_mode",
    )


@dataclass(frozen=True, kw_only=True)
class ExamplesSettings:
    """``finetune.<name>.examples``: how records become token sequences (NeMo's GPTSFTDataset options)."""

    template: str = setting("{input} {output}", "prompt_template; must end with {output}", trajectory=True)
    max_seq_length: int | None = setting(None, "tokens per example (null: the model's seq_length)")
    add_bos: bool = setting(False, "BOS before the context", trajectory=True)
    add_eos: bool = setting(True, "EOD after the answer", trajectory=True)
    answer_only_loss: bool = setting(True, "loss on the answer tokens only", trajectory=True)
    truncation_field: str = setting(
        "input",
        "NeMo's truncation_field: the template fields (comma-separated) that lose tokens first when an example "
        "is too long",
        trajectory=True,
    )
    truncation_method: str = setting(
        "left",
        "they lose tokens from their start (left: a prompt ending in its question keeps it) or end (right, "
        "NeMo's default)",
        trajectory=True,
        choices=("left", "right"),
    )
    packing: bool = setting(False, "several examples per sequence (block-diagonal attention)", trajectory=True)
    packed_attention: str = setting(
        "dense",
        "packed rows' block-diagonal attention: a dense mask through SDPA; FlexAttention's block mask, which "
        "skips the masked blocks (compiled; GPU only); or flash variable-length attention, each example a "
        "sequence of its own (torch.nn.attention.varlen; GPU only)",
        trajectory=True,
        choices=PACKED_ATTENTION,
    )
    chat_template: str | None = setting(
        None,
        "conversations: the chat template, a built-in (chatml, llama3, mistral) or a Jinja file "
        "(null: the model's own, from its tokenizer)",
        trajectory=True,
        path="file",
        path_names=CHAT_TEMPLATE_NAMES,
    )
    train_on: str = setting(
        "all_assistant",
        "conversations: the tokens trained (every assistant turn's content and end-of-turn token, the last "
        "turn's only, or every token)",
        trajectory=True,
        choices=("all_assistant", "last_assistant", "all"),
    )


@dataclass(frozen=True, kw_only=True)
class FinetuneTrainSettings(ResumeSettings):
    """``finetune.<name>.train``: steps, batch, optimizer, validation and stopping of a fine-tune."""

    steps: int = setting(REQUIRED, "optimizer steps in total", trajectory=True)
    micro_batch_size: int = setting(4, "examples per rank per forward pass", trajectory=True)
    global_batch_size: int = setting(8, "examples per step", trajectory=True)
    lr: float = setting(1.0e-4, "peak learning rate (AdamW)", trajectory=True)
    min_lr: float = setting(0.0, "learning rate at the end of the decay", trajectory=True)
    warmup_steps: int = setting(0, "linear warmup steps", trajectory=True)
    lr_decay_style: str = setting("cosine", "learning-rate decay after warmup", trajectory=True, choices=DECAY_STYLES)
    weight_decay: float = setting(0.01, "decoupled weight decay", trajectory=True)
    adam_beta1: float = setting(0.9, "AdamW beta1", trajectory=True)
    adam_beta2: float = setting(0.98, "AdamW beta2", trajectory=True)
    clip_grad: float = setting(1.0, "gradient-norm clip (0: off)", trajectory=True)
    seed: int = setting(1234, "seeds the adapters, the data order and dropout", trajectory=True)
    precision: str = setting(
        "auto",
        "auto: bf16 on GPU, fp32 on CPU; fp8: bf16 weights with the transformer blocks' matmuls (frozen base "
        "and trained) in float8 (GPUs of compute capability 8.9+)",
        trajectory=True,
        choices=PRECISIONS,
    )
    fp8_recipe: str = setting(
        "tensorwise",
        "precision fp8: one scale per tensor (tensorwise) or per row (rowwise) (enters the trajectory only with fp8)",
        trajectory=True,
        choices=FP8_RECIPES,
    )
    eval_interval: int = setting(50, "validation loss (and a checkpoint) every N steps")
    eval_examples: int = setting(0, "validation examples per evaluation (0: all)")
    patience: int = setting(0, "early stopping: evaluations without improvement (0: off)")
    min_delta: float = setting(0.001, "improvement that resets the patience")
    keep_last: int = setting(1, "newest checkpoints kept (the best is always kept)")


@dataclass(frozen=True, kw_only=True)
class FinetuneParallelSettings:
    """``finetune.<name>.parallel``: tensor parallelism, activation recomputation, FSDP, compilation and the job's
    threads."""

    tp: int = setting(
        1, "tensor-parallel size (ranks = the job's tasks; on the CPU gloo ranks, only without the base's dropout)"
    )
    recompute: str = setting(
        "none",
        "megatron-core activation recomputation: selective (core attention) or full (every transformer layer, "
        "only its input kept): less activation memory for a longer step",
        choices=("none", "selective", "full"),
    )
    fsdp: bool = setting(
        False,
        "method full: shard the parameters, gradients and optimizer states over the data-parallel ranks "
        "(PyTorch FSDP2, as pretraining's parallel.fsdp); checkpoints and the model keep their layout",
    )
    compile: bool = setting(
        False, "torch.compile each transformer layer, adapters included (GPU; as pretraining's parallel.compile)"
    )
    grad_reduce_dtype: str = setting("fp32", GRAD_REDUCE_HELP, choices=("fp32", "bf16"))
    threads: int = setting(2, "CPU threads of the job", cli=False)


@dataclass(frozen=True, kw_only=True)
class EvaluateSettings:
    """``finetune.<name>.evaluate``: greedy generation on the test split (`snakellm evaluate`)."""

    tokens_to_generate: int = setting(32, "longest answer generated")
    min_tokens_to_generate: int = setting(0, "EOD is not allowed before this many tokens")
    greedy: bool = setting(True, "argmax decoding, NeMo's SFT default (the sampling settings are then unused)")
    temperature: float = setting(1.0, "softmax temperature (sampling)")
    top_k: int = setting(0, "sample from the k most likely tokens (0: off)")
    top_p: float = setting(1.0, "nucleus sampling (1: off)")
    repetition_penalty: float = setting(1.0, "divides the logits of tokens already present (1: off)")
    end_strings: list[str] = setting([], "stop an answer at this text (it is cut off)", flag="end_string")
    seed: int = setting(1234, "sampling seed (each prompt draws from its own stream)")
    batch_size: int = setting(16, "prompts per generation batch")
    limit: int | None = setting(None, "evaluate only the first N test examples")


@dataclass(frozen=True, kw_only=True)
class FinetuneSettings:
    """``finetune.<name>``: one fine-tune of a pretrained or imported run, and its evaluation."""

    run: str = setting(REQUIRED, "the base model: a key of runs or of import_hf", cli=False)
    data: str = setting(REQUIRED, "a key of sft_data", cli=False)
    start: str | None = setting(
        None,
        "method dpo: a full fine-tune of the same run whose model the policy starts from (SFT then DPO; its "
        "dpo.reference base is then that model); null: the run's own model",
        cli=False,
    )
    method: str = setting(
        REQUIRED,
        "lora: adapters, base frozen; full: every weight; ptuning: virtual tokens, base frozen; dpo: preference "
        "tuning of preference pairs (the dpo block)",
        trajectory=True,
        choices=("lora", "full", "ptuning", "dpo"),
    )
    lora: dict[str, Any] = setting({}, "LoRA options", section=LoraSettings)
    ptuning: dict[str, Any] = setting({}, "p-tuning options", section=PtuningSettings)
    dpo: dict[str, Any] = setting({}, "preference-tuning options (method dpo)", section=DpoSettings)
    examples: dict[str, Any] = setting({}, "example building", section=ExamplesSettings)
    train: dict[str, Any] = setting(REQUIRED, "training", section=FinetuneTrainSettings)
    parallel: dict[str, Any] = setting({}, "parallelism", section=FinetuneParallelSettings)
    select: str = setting(
        "best",
        "which checkpoint is exported and evaluated: the best validation loss (NeMo's default) or the last",
        choices=("best", "last"),
    )
    evaluate: dict[str, Any] = setting({}, "evaluation", section=EvaluateSettings)
    resources: dict[str, Any] = setting({}, "the fine-tuning job's allocation", section=JobResourceSettings)
    tracking: dict[str, Any] = setting({}, "W&B and MLflow, over the global tracking", section=TrackingSettings)


# ---------------------------------------------------------------- export, import, generation


@dataclass(frozen=True, kw_only=True)
class ExportNemoSettings:
    """``export_nemo``: runs/{run}/{run}.nemo (NeMo 1.x layout)."""

    enabled: bool = setting(True, "part of the default target", cli=False)
    transformer_engine: str = setting(
        "auto",
        "transformer_engine in model_config.yaml (auto: true for RMSNorm models, false for LayerNorm ones)",
        choices=("auto", "true", "false"),
    )


@dataclass(frozen=True, kw_only=True)
class ExportHfSettings:
    """``export_hf``: runs/{run}/hf/, a Hugging Face model directory."""

    enabled: bool = setting(True, "part of the default target", cli=False)
    max_shard_size: str = setting("5GB", "largest safetensors file (e.g. 5GB, 500MB)")
    dtype: str = setting(
        "auto", "weight dtype (auto: the checkpoint's)", choices=("auto", "float32", "bfloat16", "float16")
    )


@dataclass(frozen=True, kw_only=True)
class RandomHfSettings:
    """``import_hf.<name>.random``: the workflow writes hf_dir first, a preset's shape with random weights."""

    preset: str = setting(REQUIRED, "the shape: a preset (llama3-8b, llama2-7b, tiny-llama, ...)")
    seed: int = setting(0, "seed of the weights")
    tokenizer_dir: str = setting(
        "resources/tokenizers/gpt2",
        "GPT-2's vocab.json and merges.txt (the model's tokenizer, copied in)",
        path="dir",
    )
    max_shard_size: str = setting("5GB", "largest safetensors shard")


@dataclass(frozen=True, kw_only=True)
class ImportHfSettings:
    """``import_hf.<name>``: a Hugging Face GPT-2 / Llama directory turned into a run."""

    hf_dir: str = setting(REQUIRED, "the Hugging Face model directory", cli=False, path="dir", path_unless="random")
    make_vocab_size_divisible_by: int = setting(128, "embedding padding (Megatron-LM's)")
    random: dict[str, Any] | None = setting(
        None,
        "write hf_dir (models/random/<name>) with random weights of a preset's shape first: no download",
        section=RandomHfSettings,
    )


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """``generate``: the sampling settings of `snakellm generate` (runs/{run}/samples.jsonl)."""

    enabled: bool = setting(True, "part of the default target", cli=False)
    prompts: list[str] = setting(
        ["The history of", "In the beginning", "She said that", "Botchan was"], "a prompt", flag="prompt"
    )
    max_new_tokens: int = setting(48, "tokens generated per prompt at most")
    min_new_tokens: int = setting(0, "EOD is not allowed before this many tokens")
    greedy: bool = setting(
        False,
        "argmax of the model's logits (temperature, top-k and top-p are then ignored; a repetition penalty "
        "applies only when given)",
    )
    temperature: float = setting(0.8, "softmax temperature")
    top_k: int = setting(40, "sample from the k most likely tokens (0: off)")
    top_p: float = setting(0.95, "nucleus sampling (1: off)")
    repetition_penalty: float | None = setting(
        None,
        "divides the logits of tokens already present (1: off; unset: 1.1 when sampling, off with greedy)",
    )
    end_strings: list[str] = setting([], "stop a continuation at this text", flag="end_string")
    seed: int = setting(1234, "sampling seed")
    threads: int = setting(1, "torch CPU threads of the job", cli=False)


# ---------------------------------------------------------------- lm-evaluation-harness (rules/evaluate.smk: evaluate_lm)

LM_EVAL_DEFAULT_TASKS = ["snakellm_wikitext", "snakellm_lambada", "snakellm_cont4", "snakellm_squad"]


@dataclass(frozen=True, kw_only=True)
class LmEvalSuiteSettings:
    """``lm_eval.suites.<name>``: lm-eval tasks run together on each run's Hugging Face export.

    The keys are lm-eval's own command-line options (``--tasks``, ``--num_fewshot``, ``--limit``,
    ``--batch_size``, ``--bootstrap_iters``, ``--include_path``), so a suite reads like its CLI call.
    """

    tasks: list[str] = setting(
        LM_EVAL_DEFAULT_TASKS,
        "lm-eval task names (its own, or defined by YAMLs under include_path)",
        sep=",",
    )
    num_fewshot: int | None = setting(None, "few-shot examples per prompt (null: each task's own default)")
    limit: int | None = setting(None, "evaluate only the first N documents of each task (null: all)")
    batch_size: int = setting(16, "requests per forward pass")
    bootstrap_iters: int = setting(
        1000, "bootstrap resamples for the standard error of non-mean metrics (perplexities; 0: none)"
    )
    seed: int = setting(1234, "lm-eval's random, numpy, torch and few-shot seeds")
    include_path: list[str] = setting(
        [],
        "more directories of lm-eval task YAMLs over local files (the evaluation runs offline); the workflow "
        "always adds data/lm_eval/tasks, the shipped suite",
        path="dir",
    )


@dataclass(frozen=True, kw_only=True)
class LmEvalSettings:
    """``lm_eval``: runs/{run}/lm_eval/{suite}.json for every run and import (`snakellm evaluate-lm`)."""

    enabled: bool = setting(True, "part of the default target", cli=False)
    suites: dict[str, Any] = setting(
        {"default": {"tasks": LM_EVAL_DEFAULT_TASKS, "limit": 40}},
        "suites by name",
        cli=False,
    )
    threads: int = setting(2, "torch CPU threads of the job", cli=False)


# Schema location -> settings class: what tests/test_settings.py compares (a ``*`` is any name).
SECTIONS: dict[str, type] = {
    "sources.*": SourceSettings,
    "sources.*.curate": CurateSettings,
    "sources.*.curate.near": NearDupSettings,
    "sources.*.curate.filters": CurateFiltersSettings,
    "sources.*.curate.filters.gopher_repetition": GopherRepetitionSettings,
    "sources.*.curate.filters.gopher_quality": GopherQualitySettings,
    "sources.*.curate.filters.c4": C4Settings,
    "sources.*.curate.filters.fineweb": FineWebSettings,
    "download": DownloadSettings,
    "tokenizers.*": TokenizerSettings,
    "tokenizers.*.train": TokenizerTrainSettings,
    "tokenizers.*.train.sample": SampleSettings,
    "tokenize": TokenizeSettings,
    "runs.*": RunSettings,
    "runs.*.train": TrainSettings,
    "runs.*.parallel": ParallelSettings,
    "container": ContainerSettings,
    "sft_data.*": SftDataSettings,
    "finetune.*": FinetuneSettings,
    "finetune.*.lora": LoraSettings,
    "finetune.*.ptuning": PtuningSettings,
    "finetune.*.dpo": DpoSettings,
    "finetune.*.examples": ExamplesSettings,
    "finetune.*.train": FinetuneTrainSettings,
    "finetune.*.parallel": FinetuneParallelSettings,
    "finetune.*.evaluate": EvaluateSettings,
    "export_nemo": ExportNemoSettings,
    "export_hf": ExportHfSettings,
    "import_hf.*": ImportHfSettings,
    "import_hf.*.random": RandomHfSettings,
    "generate": GenerateSettings,
    "lm_eval": LmEvalSettings,
    "lm_eval.suites.*": LmEvalSuiteSettings,
    "resources": ResourcesSettings,
    "tracking": TrackingSettings,
    "tracking.wandb": WandbSettings,
    "tracking.mlflow": MlflowSettings,
    "runs.*.tracking": TrackingSettings,
    "runs.*.tracking.wandb": WandbSettings,
    "runs.*.tracking.mlflow": MlflowSettings,
    "finetune.*.tracking": TrackingSettings,
    "finetune.*.tracking.wandb": WandbSettings,
    "finetune.*.tracking.mlflow": MlflowSettings,
}
# the job resources and their container, wherever they occur
for _where in (
    "runs.*.resources",
    "finetune.*.resources",
    *(f"resources.{f}" for f in ResourcesSettings.__dataclass_fields__),
):
    SECTIONS[_where] = JobResourceSettings
    SECTIONS[f"{_where}.container"] = ContainerSettings
