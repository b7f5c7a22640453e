"""Distributed reinforcement learning on mpidl's ranks: DQN, Ape-X and Gorila.

``sumtree`` and ``replay`` are the (sharded, prioritised) replay memory, ``dqn`` the
learning rule on mpidl layers, ``actor`` the environment side (n-step returns, per-actor
epsilon), ``envs`` the environment factory, ``roles`` which rank does what, ``apex`` and
``gorila`` the two distributed algorithms, and ``replay_check`` the single-process replay of
a deterministic run's logged event order.
"""
