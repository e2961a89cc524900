"""The GPU acceptance run: every check that needs a CUDA GPU, in one command, into one report.

`make gpu-check` (or `python -m benchmarks.gpu_check`) on a machine with one NVIDIA GPU and no
network: installs gradsync offline (`pip install --no-deps --no-index`, with the wheels of
`GPU_CHECK_WHEELS`, default `.gpu-wheels/`, which `make gpu-wheels` fills on a machine with a
registry), then runs each step in its own process, timed, with its own time limit and inside an
overall budget (default 450 s), a failing step never stopping the rest:

- the test suite's CUDA tests (marked `gpu`), the Triton kernels compiled for the device;
- the fused error-feedback kernel against a device copy and eager torch (target: >= 80% of copy
  bandwidth and faster than eager);
- ACP-SGD against Power-SGD encoding and decoding on BERT-Base's matrices (target: <= 0.55 of
  Power-SGD's time), both beside an all-reduce of the same bytes;
- `gradsync.wrap` on NCCL with one rank and on two ranks sharing the GPU over gloo, against torch
  DDP's parameters;
- Lightning's `Trainer(strategy="acp_sgd", accelerator="gpu", devices=1)`.

It writes `gpu_check.md`, `gpu_check.json` (every number, the device and the versions) and
`gpu_check.log` (each step's output) into `GPU_CHECK_DIR` (default `gpu-check-report/`).
`--dry-run` (`make gpu-check DRY_RUN=1`) runs the same driver anywhere: each step only prepares
(imports, inputs, test collection) without the modules the GPU machine lacks, so the run cannot rot.
"""
