"""Pipeline parallelism: schedules as data, a simulator, the runtime.

``schedule`` gives each pipeline rank its ordered list of actions (gpipe, 1f1b, interleaved,
zb-h1); ``simulate`` replays all ranks together to time a schedule and prove it cannot
deadlock; ``timeline`` draws what ran (simulated or recorded) as a PNG or a Chrome trace.
These three import no torch. ``runtime`` executes a rank's actions with torch.distributed
point-to-point. zb-h1's deferred weight gradients are the linear layers' own
(:mod:`hpcllm.parallel.tensor.deferred`), so the model reaches them without this package.
"""
