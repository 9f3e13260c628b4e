"""Pipeline parallelism: schedules as data, a simulator, the runtime, zero-bubble deferral.

``schedule`` gives each pipeline rank its ordered list of actions (gpipe, 1f1b, interleaved,
zb-h1); ``simulate`` replays all ranks together to time a schedule and prove it cannot
deadlock; ``timeline`` draws what ran (simulated or recorded) as a PNG or a Chrome trace.
These three import no torch. ``runtime`` executes a rank's actions with torch.distributed
point-to-point; ``zero_bubble`` lets linear layers leave their weight gradients to zb-h1's W.
"""
