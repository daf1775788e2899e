"""Collection on the training thread: where a tensor's values live across ranks (`placement`), the rows of
a step (`records`), gathering their partials and the step's one packed reduction per group
(`collector`), and the one device-to-host transfer (`transfer`)."""
