"""placeholder"""


def add_parser(sub, runtime_flags):
    pass


def run(args):
    raise NotImplementedError
