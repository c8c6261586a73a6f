"""User-facing errors: anything raised as SpecdecError is printed as one line, never a traceback."""


class SpecdecError(Exception):
    """Bad input or configuration. `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
