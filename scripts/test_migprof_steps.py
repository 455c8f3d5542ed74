"""Tests of migprof_steps.py: python3 -m unittest discover -s scripts -p 'test_*.py'"""

import json
import os
import sys
import tempfile
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import migprof_steps  # noqa: E402


class Steps(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "steps.jsonl")
        os.environ[migprof_steps.ENV] = self.path

    def tearDown(self):
        os.environ.pop(migprof_steps.ENV, None)
        if migprof_steps._out is not None:
            migprof_steps._out.close()
            migprof_steps._out = None
        sys.modules.pop("torch", None)
        self.dir.cleanup()

    def lines(self):
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def test_a_timed_block_is_one_line_with_its_items_and_phase(self):
        with migprof_steps.step(items=8, phase="train"):
            time.sleep(0.02)
        with migprof_steps.step():
            pass
        first, second = self.lines()
        self.assertEqual((first["items"], first["phase"]), (8, "train"))
        self.assertGreaterEqual(first["duration_ms"], 19.0)
        self.assertLess(first["duration_ms"], 2000.0)
        self.assertEqual(second["items"], 1)
        self.assertNotIn("phase", second)

    def test_a_step_timed_by_the_program_is_recorded_as_given(self):
        migprof_steps.record(0.25, items=4, phase="warmup")
        self.assertEqual(self.lines(), [{"duration_ms": 250.0, "items": 4, "phase": "warmup"}])

    def test_bad_items_phases_and_durations_are_refused_before_anything_is_written(self):
        for items in (0, -1, 2.5, True, "8"):
            with self.assertRaises(ValueError):
                with migprof_steps.step(items=items):
                    pass
        with self.assertRaisesRegex(ValueError, "valid phases: warmup, infer, train, generate"):
            migprof_steps.record(0.1, phase="eval")
        for secs in (0, -1, float("nan"), 1e9):
            with self.assertRaises(ValueError):
                migprof_steps.record(secs)
        self.assertFalse(os.path.exists(self.path))

    def test_a_block_that_raises_reports_nothing(self):
        with self.assertRaises(RuntimeError):
            with migprof_steps.step(items=2):
                raise RuntimeError("out of memory")
        self.assertFalse(os.path.exists(self.path) and self.lines())

    def test_outside_migprof_nothing_is_written(self):
        os.environ.pop(migprof_steps.ENV)
        with migprof_steps.step(items=3):
            pass
        migprof_steps.record(0.1)
        self.assertFalse(os.path.exists(self.path))

    def test_the_device_is_waited_for_when_pytorch_uses_cuda(self):
        calls = []
        cuda = types.SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            synchronize=lambda: calls.append("sync"),
        )
        sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
        with migprof_steps.step(items=1):
            calls.append("work")
        self.assertEqual(calls, ["sync", "work", "sync"])
        cuda.is_initialized = lambda: False
        calls.clear()
        with migprof_steps.step(items=1):
            calls.append("work")
        self.assertEqual(calls, ["work"], "a program that never touched CUDA is not made to")


if __name__ == "__main__":
    unittest.main()
