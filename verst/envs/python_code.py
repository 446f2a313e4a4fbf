"""A built-in coding environment (`env.name: python_code`): the model writes a Python solution
and the sample's unit tests, run in the episode's sandbox, are the reward.

The row carries `tests`: a list of Python statements (usually `assert f(2) == 4`), each one
test. The model's answer is its code: the last fenced block (```python ... ```) when it wrote
one, else the whole answer. The sandbox runs the solution and then each test in the
solution's namespace, each test on its own so one failure does not hide the others. The reward
is the fraction of tests that pass (0.0 when the solution itself fails to run). A failing
attempt gets the failures back as a user message and may try again until `env.max_turns`; the
episode's reward is its last attempt's fraction (set `feedback = False` in a subclass for one
attempt only).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from verst.envs.base import Action, Environment, Message, StepResult

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox: the solution once, then each test in its namespace; its verdict is one
# line behind a nonce, so a solution that exits early (os._exit(0)) or prints a verdict of its
# own scores nothing. It shares an interpreter with the solution: this stops accidents and
# cheap tricks, not code written to read the harness's frames.
_HARNESS = """\
import json, os, sys, traceback
spec = json.load(open("tests.json"))
os.remove("tests.json")  # the nonce lives only in this frame from here on
nonce, tests = spec["nonce"], spec["tests"]
def report(verdict):
    print("\\n" + nonce + json.dumps(verdict), flush=True)
namespace = {"__name__": "__main__"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
except BaseException:
    report({"error": traceback.format_exc(limit=2)[-600:], "passed": []})
    sys.exit(0)
passed, failures = [], []
for i, test in enumerate(tests):
    try:
        exec(compile(test, f"test_{i}", "exec"), dict(namespace))
        passed.append(i)
    except BaseException as e:
        failures.append(f"{test}: {type(e).__name__} {e}"[:200])
report({"passed": passed, "failures": failures})
"""


def extract_code(text: str) -> str:
    """The last fenced code block of `text`, or all of it when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


class PythonCodeEnv(Environment):
    """A coding task whose unit tests are the reward (see the module docstring)."""

    needs_sandbox = True
    feedback: bool = True

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        tests = metadata.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("python_code: the row field 'tests' must be a non-empty list of str")
        self.tests, self.score = tests, 0.0
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return list(prompt)

    async def step(self, action: Action) -> StepResult:
        assert self.sandbox is not None
        self.sandbox.put("solution.py", extract_code(action.content))
        nonce = uuid.uuid4().hex
        self.sandbox.put("tests.json", json.dumps({"nonce": nonce, "tests": self.tests}))
        self.sandbox.put("harness.py", _HARNESS)
        run = await self.sandbox.run(["python3", "harness.py"])
        verdict = _verdict(run.stdout, nonce) if run.ok else None
        if verdict is None:
            why = "timed out" if run.timed_out else f"exit {run.exit_code}: {run.stderr[-300:]}"
            verdict = {"passed": [], "error": f"the tests did not finish ({why})"}
        passed = len(verdict["passed"])
        fraction = passed / len(self.tests)
        # the step rewards telescope: the episode's sum is its last attempt's fraction
        reward, self.score = fraction - self.score, fraction
        done = fraction == 1.0 or not self.feedback
        report = verdict.get("error") or "\n".join(verdict.get("failures", []))
        observation = [] if done else [{"role": "user", "content": f"Tests failed:\n{report}"}]
        info = {"tests_passed": passed, "tests_total": len(self.tests)}
        return StepResult(observation, reward=reward, done=done, info=info)


def _verdict(stdout: str, nonce: str) -> dict[str, Any] | None:
    """The harness's verdict (the last line, behind the nonce), or None when there is none."""
    lines = stdout.strip().splitlines()
    if not lines or not lines[-1].startswith(nonce):
        return None
    try:
        verdict = json.loads(lines[-1][len(nonce) :])
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) and "passed" in verdict else None
