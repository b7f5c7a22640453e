"""Distributed reinforcement learning on mpidl's ranks: DQN, Ape-X and Gorila.

``sumtree`` and ``replay`` are the (sharded, prioritised) replay memory; ``dqn`` the
Q-networks and the update on mpidl layers, ``learner`` the update with importance weights;
``actor`` the environment side (n-step returns, per-actor epsilon, greedy evaluation) and
``envs`` the environment factory; ``roles`` which rank does what; ``protocol`` the messages;
``single`` one-process DQN, ``apex`` and ``gorila`` (on ``mpidl.ps``) the distributed
algorithms, ``run`` one rank's part of a job; ``metrics`` evaluations and JSON lines;
``replay_check`` the single-process replay of a distributed run's logged event order.
"""
