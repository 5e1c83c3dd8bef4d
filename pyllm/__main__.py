from pyllm.cli import run

run()
