import sys, time, dataclasses, collections, functools, argparse
sys.path.insert(0, "bench")
from w1_throughput import add_w1_arguments, w1_engine
from w6_structured import SCHEMA
from asyncllm import SamplingParams
import asyncllm.sample.mask_fill as mf, asyncllm.sample.structured as st, asyncllm.worker.model_runner as mr
import asyncllm.worker.sampled_outputs as so, asyncllm.core.engine_core as ec
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name, label):
    f = getattr(cls, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[label] += time.perf_counter() - t; N[label] += 1
    setattr(cls, name, g)
wrap(mf.FillJob, "accept", "job.accept")
wrap(mf.FillJob, "_start_fill", "job.start_fill")
wrap(st.GrammarTable, "fill", "table.fill")
wrap(st.GrammarTable, "plan", "table.plan")
wrap(mr.ModelRunner, "submit", "runner.submit")
wrap(mr.ModelRunner, "_sample", "runner._sample")
wrap(so._DeviceStep, "result", "devstep.result")
wrap(ec.EngineCore, "step", "core.step")
wrap(ec.EngineCore, "_complete", "core._complete")
import asyncllm.worker.input_batch as ib, asyncllm.worker.cuda_graph as cg
wrap(ib.InputBuffers, "prepare", "inputs.prepare")
wrap(ib.InputBuffers, "flush", "inputs.flush")
wrap(cg.CudaGraphRunner, "run", "graphs.run")
wrap(mr.ModelRunner, "_stage", "runner._stage")
wrap(mr.ModelRunner, "_admit", "runner._admit")
wrap(mr.ModelRunner, "_release_held", "runner._release_held")
import asyncllm.sample.sampler as smp
wrap(smp.Sampler, "__call__", "sampler.call")
wrap(mf.DeviceMasks, "upload", "masks.upload")
wrap(mf.FillJob, "wait_filled", "job.wait_filled")
wrap(st.GrammarTable, "sent", "table.sent")
import os, xgrammar
THREADS = int(os.environ.get("FILL_THREADS", "0"))
if THREADS:
    orig_init = mf.Filler.__init__
    def init(self):
        orig_init(self); self._many = xgrammar.BatchGrammarMatcher(max_threads=THREADS)
    mf.Filler.__init__ = init
ap = argparse.ArgumentParser(); add_w1_arguments(ap); args = ap.parse_args([])
llm = w1_engine(args)
prompt = [[(7 * i) % 10000 for i in range(128)]]
for schema in (() if THREADS else (None, SCHEMA)):
    p = SamplingParams(temperature=0.6, ignore_eos=schema is None, max_tokens=512, json_schema=schema)
    llm.generate(prompt, dataclasses.replace(p, max_tokens=16), use_tqdm=False)
    T.clear(); N.clear()
    t0 = time.perf_counter(); out = llm.generate(prompt, p, use_tqdm=False)[0]; dt = time.perf_counter() - t0
    n = len(out.token_ids)
    print(f"schema={schema is not None} tokens={n} ms/token={1000*dt/n:.3f}")
    for k in sorted(T): print(f"  {k:18s} calls={N[k]:5d} us/call={1e6*T[k]/max(N[k],1):8.1f} us/token={1e6*T[k]/n:8.1f}")
prompts = [[(7 * i + j) % 10000 for i in range(128)] for j in range(256)]

p = SamplingParams(temperature=0.6, max_tokens=400, json_schema=SCHEMA)
llm.generate(prompts[:8], p, use_tqdm=False)
T.clear(); N.clear()
t0 = time.perf_counter(); outs = llm.generate(prompts, [dataclasses.replace(p, seed=i) for i in range(256)], use_tqdm=False); dt = time.perf_counter() - t0
n = sum(len(o.token_ids) for o in outs)
steps = N["core.step"]
print(f"256 schema tokens={n} s={dt:.3f} tok/s={n/dt:.0f} steps={steps} ms/step={1000*dt/steps:.3f}")
for k in sorted(T): print(f"  {k:18s} calls={N[k]:5d} us/call={1e6*T[k]/max(N[k],1):8.1f} ms/step={1e3*T[k]/steps:8.3f}")
lens = [len(o.token_ids) for o in outs]
T.clear(); N.clear()
t0 = time.perf_counter(); outs = llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=L, seed=i) for i, L in enumerate(lens)], use_tqdm=False); dt = time.perf_counter() - t0
steps = N["core.step"]
print(f"256 plain tokens={n} s={dt:.3f} tok/s={n/dt:.0f} steps={steps} ms/step={1000*dt/steps:.3f}")
for k in sorted(T): print(f"  {k:18s} calls={N[k]:5d} us/call={1e6*T[k]/max(N[k],1):8.1f} ms/step={1e3*T[k]/steps:8.3f}")
