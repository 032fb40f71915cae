"""Results name the machine that made them: on CPU the processor and its vector ISA."""

import pathlib
import subprocess

import jax

from attention_jax.train import provenance
from experiments import readme_tables

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512_bf16 aes
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 sse4_1
"""


def test_host_cpu_reads_the_model_and_the_vector_extensions_of_the_first_processor():
  model, isa = provenance.host_cpu(X86_CPUINFO)
  assert model == "AMD EPYC 7B13"
  assert isa == ("avx", "avx2", "avx512_bf16", "avx512f", "f16c", "fma", "sse4_1", "sse4_2")
  arm_model, arm_isa = provenance.host_cpu("Features\t: fp asimd evtstrm sve aes\n")
  assert arm_isa == ("asimd", "sve") and arm_model  # the model falls back to platform's


def test_device_summary_on_cpu_names_the_processor_and_the_description_shows_it():
  summary = provenance.device_summary()
  assert summary["platform"] == jax.devices()[0].platform == "cpu"
  model, isa = provenance.host_cpu()
  assert summary["cpu_model"] == model and summary["cpu_isa"] == list(isa)
  described = provenance.describe_devices(summary)
  assert described.startswith(f"{summary['count']} x cpu ({model}")
  # An older results file, without the processor fields, reads as before.
  assert provenance.describe_devices(dict(count=1, kind="cpu", platform="cpu")) == "1 x cpu"


def test_readme_provenance_reads_the_compare_header_with_the_processor():
  header = ("listops (smoke), 1 x cpu (AMD EPYC 7B13; avx, avx2, fma), git 0123456789abcdef\n\n"
            "| variant |\n|---|\n")
  assert readme_tables.provenance(header) == "git 0123456, 1 x cpu (AMD EPYC 7B13; avx, avx2, fma)"
  assert readme_tables.provenance("listops (smoke), 1 x cpu, git 0123456789\n") == (
      "git 0123456, 1 x cpu")


def test_git_revision_is_the_checkout_head_or_the_revision_the_sender_names(monkeypatch):
  monkeypatch.delenv("ATTENTION_JAX_GIT_REVISION", raising=False)
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).parent,
                        capture_output=True, text=True, check=True).stdout.strip()
  assert provenance.git_revision() in (head, head + "+dirty")
  # A tree sent to a lent GPU carries a stale .git: the sender names the commit.
  monkeypatch.setenv("ATTENTION_JAX_GIT_REVISION", "0123abc")
  assert provenance.git_revision() == "0123abc"
