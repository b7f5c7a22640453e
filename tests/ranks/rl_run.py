"""Run an RL job's rank with settings from a JSON argument (tests): ``rl_run.py '{...}'``."""

import json
import sys

from mpidl.comm import Communicator
from mpidl.rl.config import RLConfig
from mpidl.rl.run import check, run

kw = json.loads(sys.argv[1])
if "hidden" in kw:
    kw["hidden"] = tuple(kw["hidden"])
cfg = RLConfig(**kw)
comm = Communicator()
roles, obs_shape, n_actions = check(cfg, comm.size)
run(cfg, comm, roles, obs_shape, n_actions)
comm.barrier()
comm.close()
