/* The turn of a virtual rank, handed on without the interpreter lock in between.
 *
 * simcomm.sim.scheduler lets one rank thread run at a time. Handing the turn on
 * with Python locks takes two wake-ups of the next rank: `next.release()` wakes it
 * while the caller still holds the interpreter lock (GIL), so it wakes only to sleep
 * again on the GIL, and wakes a second time when the caller blocks in
 * `mine.acquire()` and drops the GIL. `handoff(next, mine)` drops the GIL first, then
 * posts `next` and waits on `mine`: the next rank wakes once, to a free GIL.
 *
 * A Waiter is a POSIX semaphore that starts at 0: `release()` posts it, `acquire()`
 * waits on it (the GIL dropped). Like the pre-acquired `threading.Lock` the
 * scheduler used before, any thread may release a waiter that another waits on.
 * Where unnamed POSIX semaphores do not work, creating a Waiter raises OSError and
 * the scheduler keeps its Python locks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <semaphore.h>

typedef struct {
    PyObject_HEAD
    sem_t sem;
    int ready;    /* sem_init succeeded: sem_destroy is owed */
} Waiter;

static PyTypeObject WaiterType;

static int Waiter_init(Waiter *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ":Waiter", names)) {
        return -1;
    }
    if (self->ready) {
        return 0;
    }
    if (sem_init(&self->sem, 0, 0) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void Waiter_dealloc(Waiter *self) {
    if (self->ready) {
        sem_destroy(&self->sem);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* sem_wait with the GIL already dropped: resumed when a signal interrupts it */
static int wait_on(sem_t *sem) {
    int result;
    do {
        result = sem_wait(sem);
    } while (result != 0 && errno == EINTR);
    return result;
}

static int check_ready(Waiter *waiter) {
    if (!waiter->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Waiter used before its __init__");
        return 0;
    }
    return 1;
}

static PyObject *Waiter_release(Waiter *self, PyObject *unused) {
    if (!check_ready(self)) {
        return NULL;
    }
    if (sem_post(&self->sem) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Waiter_acquire(Waiter *self, PyObject *unused) {
    int result;
    if (!check_ready(self)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    result = wait_on(&self->sem);
    Py_END_ALLOW_THREADS
    if (result != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_TRUE;
}

static PyObject *handoff(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Waiter *wake, *wait;
    int posted, waited;
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &WaiterType) || !PyObject_TypeCheck(args[1], &WaiterType)) {
        PyErr_SetString(PyExc_TypeError, "handoff(wake, wait) takes two Waiters");
        return NULL;
    }
    wake = (Waiter *)args[0];
    wait = (Waiter *)args[1];
    if (!check_ready(wake) || !check_ready(wait)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    posted = sem_post(&wake->sem);
    waited = posted == 0 ? wait_on(&wait->sem) : -1;
    Py_END_ALLOW_THREADS
    if (posted != 0 || waited != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Waiter_methods[] = {
    {"release", (PyCFunction)Waiter_release, METH_NOARGS, "Post: one waiting (or the next) acquire returns."},
    {"acquire", (PyCFunction)Waiter_acquire, METH_NOARGS,
     "Wait until released, without the interpreter lock; returns True."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef module_methods[] = {
    {"handoff", (PyCFunction)(void (*)(void))handoff, METH_FASTCALL,
     "handoff(wake, wait): drop the interpreter lock, release `wake`, wait on `wait`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "simcomm.sim._handoff",
    "A virtual rank's turn handed on with one wake-up (POSIX semaphores).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__handoff(void) {
    PyObject *module;
    WaiterType.tp_name = "simcomm.sim._handoff.Waiter";
    WaiterType.tp_basicsize = sizeof(Waiter);
    WaiterType.tp_flags = Py_TPFLAGS_DEFAULT;
    WaiterType.tp_doc = "A semaphore that starts at 0: release() posts, acquire() waits without the GIL.";
    WaiterType.tp_new = PyType_GenericNew;
    WaiterType.tp_init = (initproc)Waiter_init;
    WaiterType.tp_dealloc = (destructor)Waiter_dealloc;
    WaiterType.tp_methods = Waiter_methods;
    if (PyType_Ready(&WaiterType) < 0) {
        return NULL;
    }
    module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&WaiterType);
    if (PyModule_AddObject(module, "Waiter", (PyObject *)&WaiterType) < 0) {
        Py_DECREF(&WaiterType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
