"""Pipeline parallelism: schedules as data, a simulator that replays them, timeline drawings.

``schedule`` gives each pipeline rank its ordered list of actions (gpipe, 1f1b, interleaved,
zb-h1); ``simulate`` replays all ranks together to time a schedule and prove it cannot
deadlock; ``timeline`` draws what ran (simulated or recorded) as a PNG or a Chrome trace.
None of them imports torch.
"""
