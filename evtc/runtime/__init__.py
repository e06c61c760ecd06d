"""The runtime: building and loading kernels (:mod:`evtc.runtime.build`, :mod:`evtc.runtime.cache`),
the compiled kernel object and its call path (:mod:`evtc.runtime.kernel`), aligned copies
(:mod:`evtc.runtime.staging`), the torch path (:mod:`evtc.runtime.fallback`), reductions finished
after the kernel (:mod:`evtc.runtime.reductions`) and the PyTorch custom operator
(:mod:`evtc.runtime.torch_op`)."""
