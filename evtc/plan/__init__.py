"""The kernel plan: what one compiled kernel is, decided once at compile time from the graph and
the example inputs: the GEMM configuration (:mod:`evtc.plan.config`), the static layouts of every
tensor argument (:mod:`evtc.plan.signature`), the shared-memory planner and configuration search
(:mod:`evtc.plan.smem`) and the per-problem cluster choice (:mod:`evtc.plan.clusters`)."""
