"""The command line of the rank programs whose cases take no arguments: `python X.py CASE`."""
import argparse


def run_case(cases, doc, argv=None):
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(cases))
    cases[parser.parse_args(argv).case]()
