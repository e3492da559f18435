"""schedspec.testing: hold a scheduler to the spec from your own test suite.

``SchedulerContract`` is the base class to subclass (see
schedspec.testing.contract); ``schedspec.testing.strategies`` holds the
Hypothesis strategies; ``schedspec.testing.stateful`` the state machine.
Importing it registers no Hypothesis profile.
"""

from schedspec.check.capabilities import Capabilities
from schedspec.testing.contract import ContractError, SchedulerContract, hypothesis_settings_in_force

__all__ = ["Capabilities", "ContractError", "SchedulerContract", "hypothesis_settings_in_force"]
