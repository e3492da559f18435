"""schedspec: an executable specification of vLLM 0.33's v1 scheduler, a fast
scheduler proven equal to it, and the tools that hold any scheduler to it.

Everything lives under this one namespace; see the README's "Layout" section
for which package may import which. Importing ``schedspec`` imports nothing else.
"""

__version__ = "0.1.0"
