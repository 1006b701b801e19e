// The Python module specdec_kernels._C. It holds no functions: importing it loads this
// shared library, whose static initialisers register the specdec ops with the dispatcher
// (torch.ops.specdec.*). Plain CPython API instead of pybind11 keeps the build light.
#include <Python.h>

static struct PyModuleDef specdec_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&specdec_module); }
