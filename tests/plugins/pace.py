"""A test-only loop plug-in that sets the pace of a run: each step takes at least PACE_S seconds more (a sleep after
its dispatch), and process 0 prints when each step's sleep ended, `pace: step N at UNIX_TIME`. For tests whose
events are timed by a clock outside the run (a scheduler's time limit), on a host whose CPU others share."""
import os
import time

import jax

from trainer.run.plugin import Plugin


class Pace(Plugin):
    def __init__(self, run):
        self.pause = float(os.environ.get("PACE_S", "0.5"))

    def after_step(self, run, step):
        time.sleep(self.pause)
        if jax.process_index() == 0:
            print(f"pace: step {step} at {time.time():.3f}", flush=True)
