"""Head-to-head: torch DDP, its PowerSGD hook and gradsync's plans on an emulated cluster.

Each setting (model × ranks × network) runs as one job on the netbed (one rank per network
namespace, `tc`-shaped links): every rank holds one copy of the model per row, plus a copy trained
without communication (the compute-only reference). Each gradsync row first runs alone until it
has measured its profile and, for `auto`, timed its plans. Then rows run interleaved in blocks —
each round in another order (`round_order`) — after warm-up rounds (DDP's bucket rebuild, the
compressors' uncompressed start); each block starts after a barrier with one untimed step, so
that the timed steps run as in training: the first one's forward waits for that step's ops of a
plan that overlaps the next forward pass, as every later one does, and the last timed step's ops
complete after the clock stops (in training the next forward waits for them), before the next
block: no row borrows another's time. A block's time is its slowest rank's. torch DDP and gradsync
ddp_buckets (the same buckets) run several blocks each per round, alternating: the runtime's
overhead is the median of their back-to-back ratios. One all-reduce cost model is measured per job
and given to every gradsync row; it is fitted twice more, midway through the timed rounds and after
them, and the rows' predictions are made with the median of the three fits (the host's interference
drifts over a run: see `median_cost`), beside those made with the first fit alone.
`--emulated` runs the zoo's ResNet-50, BERT-Base and MobileNet-V2 on emulated accelerators
(gradsync.emulated: the layers' device times waited off the core, tensors scaled down with the link
rates) at 4 and 8 ranks, and reports each setting's CPU use and steal beside its rows.
`--topology` runs the rows on per-pair rate limits of a gradsync topology instead of uniform NICs.
Rows run only when named: mg_wfbp_overlap and optimal_merge_overlap, the plans with their waits
deferred to the next forward (the planners' `overlap_forward`).

    .venv/bin/python -m benchmarks.head_to_head              # every setting (about 30 minutes)
    .venv/bin/python -m benchmarks.head_to_head --quick      # CNN, 2 ranks, 1 Gbit/s, four rows
    .venv/bin/python -m benchmarks.head_to_head --emulated   # the zoo's models on emulated V100s, 4 and 8 ranks
    .venv/bin/python -m benchmarks.head_to_head --models transformer --world-sizes 2 --rates 1gbit \\
        --rows ddp ddp_powersgd acp_sgd

The package's modules: `workloads` (the models and their synthetic batches), `rows` (what each row
runs), `job` (one rank of a setting: the rows interleaved in blocks), `results` (the ranks' reports
summarised per row), `targets` (the project's targets and their verdicts), `report` (the markdown,
JSON and chart), `driver` (the command line and the netbed runs).
"""
