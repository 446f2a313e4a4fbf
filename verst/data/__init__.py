"""Prompt data: files and procedural tasks served as groups of Samples."""

from verst.data.source import DataSource, DataSourceConfig, load_rows
from verst.data.tasks import TASKS, make_task

__all__ = ["TASKS", "DataSource", "DataSourceConfig", "load_rows", "make_task"]
