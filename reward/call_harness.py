"""In-sandbox harness for call-based problems (a test case calls a function instead of feeding stdin).

Run inside the sandbox as ``python -I -S -B call_harness.py PROGRAM FN_NAME``; standard library
only. Reads the call's arguments as a JSON list on stdin, executes the program as a module,
calls ``FN_NAME`` (a top-level function, or a method of a ``Solution`` class) and writes the
JSON-encoded return value after a marker line on stdout. The program's own prints are
discarded. The parent compares the value; nothing here decides whether it is right.
"""

import io
import json
import sys

RESULT_MARKER = "\x00colossal-rl-result\x00"


def _find_function(namespace: dict, fn_name: str):
    if callable(namespace.get(fn_name)):
        return namespace[fn_name]
    solution = namespace.get("Solution")
    if solution is not None and callable(getattr(solution, fn_name, None)):
        return getattr(solution(), fn_name)
    raise NameError(f"no function or Solution method named {fn_name!r}")


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(item) for item in value), key=repr)
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return value


def main() -> None:
    program_path, fn_name = sys.argv[1], sys.argv[2]
    arguments = json.loads(sys.stdin.read())
    if not isinstance(arguments, list):
        arguments = [arguments]
    real_stdout = sys.stdout
    sys.stdout = io.StringIO()
    namespace = {"__name__": "__solution__"}
    with open(program_path, encoding="utf-8") as handle:
        source = handle.read()
    exec(compile(source, "solution.py", "exec"), namespace)
    result = _find_function(namespace, fn_name)(*arguments)
    encoded = json.dumps(_jsonable(result))
    sys.stdout = real_stdout
    real_stdout.write(RESULT_MARKER + "\n" + encoded + "\n")
    real_stdout.flush()


if __name__ == "__main__":
    main()
