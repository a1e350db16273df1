#!/usr/bin/env python3
"""Reads TensorBoard event files back with Python's `tensorboard` package, as TensorBoard itself does.

Used by tests/tensorboard_test.cpp and examples/tests/check_tensorboard.sh. Output is one record per
line, tab-separated, values as Python's repr() (exact: a float32 simple_value prints as the double it is).

  read_tensorboard.py scalars RUN_DIR     EventAccumulator (TensorBoard's loader, CRC-checked):
      file_version\t<version>
      scalar\t<tag>\t<step>\t<value>\t<wall_time>
      histogram\t<tag>\t<step>\t<min>\t<max>\t<num>\t<sum>\t<sum_squares>\t<limits,...>\t<counts,...>
  read_tensorboard.py records EVENT_FILE  the raw TFRecord reader, record by record:
      record\t<index>\t<bytes>
      end\tok        or      end\terror\t<DataLossError message>
  read_tensorboard.py runs LOG_DIR        every run under LOG_DIR (EventMultiplexer, as `tensorboard --logdir`):
      run\t<run>\t<tag>\t<count>\t<first step>\t<last step>\t<last value>

Exits 3 with a message when the `tensorboard` package is missing.
"""
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator, event_multiplexer
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
    from tensorboard.compat.proto import event_pb2
except ImportError as e:  # pragma: no cover
    print(f"python tensorboard package missing: {e}", file=sys.stderr)
    sys.exit(3)

KEEP_ALL = {event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.TENSORS: 0}


def scalars(path):
    acc = event_accumulator.EventAccumulator(path, size_guidance=KEEP_ALL)
    acc.Reload()
    print(f"file_version\t{acc.file_version!r}")
    tags = acc.Tags()
    for tag in sorted(tags[event_accumulator.SCALARS]):
        for e in acc.Scalars(tag):
            print(f"scalar\t{tag}\t{e.step}\t{e.value!r}\t{e.wall_time!r}")
    for tag in sorted(tags[event_accumulator.HISTOGRAMS]):
        for e in acc.Histograms(tag):
            h = e.histogram_value
            limits = ",".join(repr(x) for x in h.bucket_limit)
            counts = ",".join(repr(x) for x in h.bucket)
            print(f"histogram\t{tag}\t{e.step}\t{h.min!r}\t{h.max!r}\t{h.num!r}\t{h.sum!r}\t{h.sum_squares!r}"
                  f"\t{limits}\t{counts}")


def records(path):
    reader = PyRecordReader_New(path)
    index = 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            print("end\tok")
            return
        except errors.DataLossError as e:
            print(f"end\terror\t{e.message}")
            return
        data = reader.record()
        event_pb2.Event.FromString(data)  # every record must parse as an Event
        print(f"record\t{index}\t{len(data)}")
        index += 1


def runs(path):
    mux = event_multiplexer.EventMultiplexer(size_guidance=KEEP_ALL)
    mux.AddRunsFromDirectory(path)
    mux.Reload()
    for run, tags in sorted(mux.Runs().items()):
        for tag in sorted(tags[event_accumulator.SCALARS]):
            events = mux.Scalars(run, tag)
            print(f"run\t{run}\t{tag}\t{len(events)}\t{events[0].step}\t{events[-1].step}\t{events[-1].value!r}")
        for tag in sorted(tags[event_accumulator.HISTOGRAMS]):
            events = mux.Histograms(run, tag)
            print(f"run\t{run}\t{tag}\t{len(events)}\t{events[0].step}\t{events[-1].step}\thistogram")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("scalars", "records", "runs"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    {"scalars": scalars, "records": records, "runs": runs}[sys.argv[1]](sys.argv[2])
