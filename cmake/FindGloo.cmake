# Gloo's headers (not shipped in the torch wheel; Debian's libgloo-dev has
# them). Only needed to create Gloo process groups from C++ without Python.
find_path(Gloo_INCLUDE_DIR gloo/algorithm.h PATHS /usr/include /usr/local/include)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Gloo REQUIRED_VARS Gloo_INCLUDE_DIR)
if(Gloo_FOUND AND NOT TARGET Gloo::headers)
  add_library(Gloo::headers INTERFACE IMPORTED)
  set_target_properties(Gloo::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${Gloo_INCLUDE_DIR}")
endif()
