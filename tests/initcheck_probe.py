"""Does compute-sanitizer's initcheck see the kernel's TMA stores? An output the kernel wrote
into a fresh (uninitialised) tensor is read back by torch; run under initcheck, a report here means
initcheck does not track bulk-tensor stores (cp.async.bulk.tensor), not that an element is unwritten:
each output is compared with a run into a NaN-poisoned buffer, so an unwritten element would show."""

import torch

import evtc


def epilogue(acc, bias):
    return acc + bias


a = torch.randn(70, 40, device="cuda").half()
b = torch.randn(40, 48, device="cuda").half()
bias = torch.randn(48, device="cuda")
k = evtc.compile(epilogue, dict(a=a, b=b, bias=bias))
fresh = k(a, b, bias=bias)  # torch.empty output, written only by TMA stores
print("fresh output read back:", fresh.float().sum().item())
poisoned = torch.full_like(fresh, float("nan"))
k(a, b, bias=bias, out=poisoned)
assert torch.equal(poisoned, fresh), "the two runs differ"
print("matches the poisoned run; path", k.last_path)

# The same into a padded, uninitialised buffer (row pitch 64 for 48 columns: TMA-legal, so the kernel
# path), then against a poisoned padded buffer: equal means every element was written.
padded = torch.empty(70, 64, device="cuda", dtype=torch.float16)[:, :48]
k(a, b, bias=bias, out=padded)
print("padded output read back:", padded.float().sum().item(), "path", k.last_path)
poisoned = torch.full((70, 64), float("nan"), device="cuda", dtype=torch.float16)[:, :48]
k(a, b, bias=bias, out=poisoned)
assert torch.equal(poisoned, fresh) and torch.equal(padded, fresh), "padded runs differ"
print("padded runs match")
