/*
 * kg-spawn-helper: the one exec between the gateway and bwrap.
 *
 *   kg-spawn-helper [--cgroup=/abs/.../cgroup.procs]... [--rlimit=RESOURCE:VALUE]...
 *                   [--uid=UID --gid=GID] [--parent=PID] -- /abs/program [ARG]...
 *
 * Joins each cgroup (writes its own pid to the cgroup.procs file), sets each
 * resource limit (soft and hard) to VALUE, then, with --uid, drops every
 * supplementary group and becomes UID/GID (real, effective and saved).  With
 * --parent it asks for SIGKILL when its parent (the gateway) dies, and exits
 * at once if that parent is already gone.  Then it execs the program by its
 * absolute path (no PATH search; the environment is passed on untouched: the
 * gateway gives it a fixed one).
 *
 * So everything bwrap and the sandbox will run is in its cgroups and under
 * its limits from the start, and the gateway never forks itself or waits on
 * the cgroup write (a migration waits for every fork in progress on the host,
 * and bwrap's clone of its namespaces takes milliseconds: that must not stall
 * the gateway's event loop).  It is what
 * `prlimit ... -- setpriv ... -- bwrap` does, in one small static exec
 * instead of two dynamic ones.  Any failure exits 127 before the program runs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

static void fail(const char *what, const char *arg) {
    fprintf(stderr, "kg-spawn-helper: %s%s%s%s%s\n", what, arg ? " " : "", arg ? arg : "",
            errno ? ": " : "", errno ? strerror(errno) : "");
    _exit(127);
}

static unsigned long long number(const char *text, const char *arg) {
    char *end;
    errno = 0;
    if (*text < '0' || *text > '9') fail("not a number in", arg);
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || (*end != '\0' && *end != ':')) fail("not a number in", arg);
    return value;
}

int main(int argc, char **argv) {
    long long uid = -1, gid = -1, parent = -1;
    int i;
    for (i = 1; i < argc; i++) {
        const char *arg = argv[i];
        errno = 0;
        if (strcmp(arg, "--") == 0) {
            i++;
            break;
        } else if (strncmp(arg, "--cgroup=", 9) == 0) {
            const char *path = arg + 9;
            if (path[0] != '/') fail("expected an absolute cgroup.procs path, got", arg);
            int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
            if (fd < 0) fail("cannot open", path);
            if (write(fd, "0", 1) != 1) fail("cannot join", path);
            close(fd);
        } else if (strncmp(arg, "--parent=", 9) == 0) {
            parent = (long long)number(arg + 9, arg);
        } else if (strncmp(arg, "--rlimit=", 9) == 0) {
            const char *colon = strchr(arg + 9, ':');
            if (!colon) fail("expected --rlimit=RESOURCE:VALUE, got", arg);
            struct rlimit limit;
            int resource = (int)number(arg + 9, arg);
            limit.rlim_cur = limit.rlim_max = (rlim_t)number(colon + 1, arg);
            if (setrlimit(resource, &limit) != 0) fail("cannot set", arg);
        } else if (strncmp(arg, "--uid=", 6) == 0) {
            uid = (long long)number(arg + 6, arg);
        } else if (strncmp(arg, "--gid=", 6) == 0) {
            gid = (long long)number(arg + 6, arg);
        } else {
            fail("unknown option", arg);
        }
    }
    if (i >= argc || argv[i][0] != '/') fail("expected -- and an absolute program path", NULL);
    if ((uid < 0) != (gid < 0) || uid > UINT_MAX - 1 || gid > UINT_MAX - 1) fail("give both --uid and --gid", NULL);
    if (uid >= 0) {
        errno = 0;
        if (setgroups(0, NULL) != 0) fail("setgroups", NULL);
        if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) != 0) fail("setresgid", NULL);
        if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0) fail("setresuid", NULL);
        uid_t r, e, s;
        gid_t rg, eg, sg;
        if (getresuid(&r, &e, &s) || r != uid || e != uid || s != uid) fail("uid did not change", NULL);
        if (getresgid(&rg, &eg, &sg) || rg != gid || eg != gid || sg != gid) fail("gid did not change", NULL);
        if (getgroups(0, NULL) != 0) fail("supplementary groups remain", NULL);
    }
    if (parent >= 0) {
        /* After the uid change, which clears it; it survives the exec of an ordinary bwrap. */
        errno = 0;
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail("prctl PR_SET_PDEATHSIG", NULL);
        if ((long long)getppid() != parent) _exit(127); /* the gateway is gone already */
    }
    execv(argv[i], argv + i);
    fail("cannot exec", argv[i]);
    return 127;
}
