"""Environments for multi-turn episodes, and the sandboxes they run commands in.

An environment (`verst.envs.base.Environment`) is played through the agent-function layer, so
every token of an episode still goes through the session server; `verst.envs.sandbox` gives
each episode a sandbox of its own. See docs/environments.md.
"""
