/*
 * snapinit: pid 1 of one rank's sandbox (a fresh PID namespace).
 *
 *   snapinit --pid-fd N [--init-cwd DIR] [--private-tmp DIR] [--netns PATH] [--fd SRC:DST]...
 *            -- argv...
 *
 * With --private-tmp DIR the outer process first unshares a mount namespace (propagation made
 * private, so nothing leaks either way), mounts a fresh tmpfs on DIR (an existing directory),
 * sets TMPDIR=DIR, reopens stdin from /dev/null and re-executes itself (the init later mounts
 * its PID namespace's own /proc there): everything the
 * sandbox maps or opens from then on (this binary included) lives on the new namespace's
 * mounts, which CRIU dumps with the tree (the tmpfs with its contents). Python's
 * multiprocessing binds its listeners under TMPDIR, so copies restored from one snapshot on
 * one machine each get their own sockets instead of stealing each other's paths.
 *
 * The outer process optionally enters the network namespace PATH (setns, nothing else),
 * moves fd SRC to DST for each --fd, closes every other fd above 2 (close_range: the caller's
 * fd numbers may be anything, and none of its descriptors may reach the rank), unshares a PID
 * namespace and forks its pid 1 (the init), writes the init's host pid ("1234\n") to fd N,
 * lets the init go on and exits at once. The init waits for that word before anything else:
 * if the pid never reaches the caller, it exits and no rank runs. The init is re-parented to
 * the caller (a child subreaper), so the tree at launch, caller -> init -> rank, is the tree
 * CRIU restores.
 *
 * The init: setsid() (CRIU needs the root of a pid namespace to lead its session), forks the
 * rank (original cwd, execvp argv, inherited environment and fds), then chdir(DIR) for itself
 * only: CRIU's parasite makes a temporary "proc.crtools" directory in the root task's cwd, so
 * two parallel dumps of sandboxes sharing a cwd collide unless each init has its own.
 * It forwards TERM/INT/HUP/USR1/USR2/QUIT to the rank, reaps every child and exits with the
 * rank's status (128+signal if the rank was killed). It waits in sigwaitinfo(), which CRIU
 * interrupts (EINTR) on dump and restore; the loop simply retries.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_FDS 16
#define HIGH_FD 64 /* scratch fds live at >= HIGH_FD; targets must be below it */
#ifndef SYS_close_range
#define SYS_close_range 436 /* the same number on every architecture */
#endif

static const int fwd_sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT};

static void die(const char *what)
{
	fprintf(stderr, "snapinit: %s: %s\n", what, strerror(errno));
	_exit(127);
}

static void usage(void)
{
	fprintf(stderr, "usage: snapinit --pid-fd N [--init-cwd DIR] [--private-tmp DIR] "
			"[--netns PATH] [--fd SRC:DST]... -- argv...\n");
	_exit(2);
}

/*
 * Close every fd in [lo, hi] (hi may be ~0U: all of them). close_range(2) where the kernel has
 * it (5.9+); otherwise the fds /proc/self/fd lists. Never a loop up to a guessed maximum: the
 * agent's own fd numbers grow past any fixed bound, and whatever it passed us by mistake must
 * not reach the rank.
 */
static void close_fds(unsigned int lo, unsigned int hi)
{
	DIR *d;
	struct dirent *e;

	if (lo > hi)
		return;
	if (syscall(SYS_close_range, lo, hi, 0) == 0)
		return;
	d = opendir("/proc/self/fd");
	if (!d)
		die("close_range and /proc/self/fd both unavailable");
	while ((e = readdir(d)) != NULL) {
		char *end;
		long fd = strtol(e->d_name, &end, 10);

		if (*end || end == e->d_name || fd == dirfd(d))
			continue;
		if ((unsigned long)fd >= lo && (unsigned long)fd <= hi)
			close((int)fd);
	}
	closedir(d);
}

/* Close every fd >= lo except `keep` (-1: none). */
static void close_all_from(int lo, int keep)
{
	if (keep < lo) {
		close_fds((unsigned int)lo, ~0U);
		return;
	}
	if (keep > lo)
		close_fds((unsigned int)lo, (unsigned int)keep - 1);
	close_fds((unsigned int)keep + 1, ~0U);
}

static int run_init(char **argv, const char *init_cwd, const sigset_t *set)
{
	int status, rank_status = 0, rank_done = 0;
	siginfo_t si;
	pid_t rank, pid;

	if (setsid() < 0)
		die("setsid");
	rank = fork();
	if (rank < 0)
		die("fork rank");
	if (rank == 0) {
		sigset_t none;

		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		execvp(argv[0], argv);
		die(argv[0]);
	}
	if (init_cwd && chdir(init_cwd) < 0)
		fprintf(stderr, "snapinit: chdir %s: %s\n", init_cwd, strerror(errno));
	/* The rank's control pipes belong to the rank; holding them would hide its EOFs. */
	close_all_from(3, -1);

	while (!rank_done) {
		if (sigwaitinfo(set, &si) < 0) {
			if (errno == EINTR)
				continue;
			die("sigwaitinfo");
		}
		if (si.si_signo != SIGCHLD) {
			kill(rank, si.si_signo);
			continue;
		}
		while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
			if (pid == rank) {
				rank_status = status;
				rank_done = 1;
			}
		}
	}
	if (WIFSIGNALED(rank_status))
		return 128 + WTERMSIG(rank_status);
	return WEXITSTATUS(rank_status);
}

/* --private-tmp DIR (argv[at], argv[at + 1]): see the header. Does not return. */
static void private_tmp(int argc, char **argv, int at)
{
	const char *dir = argv[at + 1];
	char exe[4096], **nargv;
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	int fd, i, j;

	if (n < 0)
		die("readlink /proc/self/exe");
	exe[n] = 0;
	if (unshare(CLONE_NEWNS) < 0)
		die("unshare(CLONE_NEWNS)");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		die("mount --make-rprivate /");
	if (mount("tmpfs", dir, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") < 0)
		die(dir);
	if (setenv("TMPDIR", dir, 1) < 0)
		die("setenv TMPDIR");
	/* stdin (/dev/null) was opened on the host's mounts, which CRIU cannot look up. */
	fd = open("/dev/null", O_RDONLY);
	if (fd < 0 || dup2(fd, 0) < 0)
		die("/dev/null");
	if (fd != 0)
		close(fd);
	nargv = calloc(argc + 1, sizeof(*nargv));
	if (!nargv)
		die("calloc");
	for (i = 0, j = 0; i < argc; i++) /* --private-tmp DIR -> --mounted */
		if (i == at)
			nargv[j++] = "--mounted";
		else if (i != at + 1)
			nargv[j++] = argv[i];
	execv(exe, nargv); /* by path, resolved on the new namespace's mounts */
	die(exe);
}

int main(int argc, char **argv)
{
	int pid_fd = -1, nfds = 0, src[MAX_FDS], dst[MAX_FDS], max_dst = 2, i;
	const char *init_cwd = NULL, *netns = NULL;
	int mounted = 0;
	sigset_t set;
	char buf[32];
	int go[2];
	pid_t init;

	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--")) {
			i++;
			break;
		} else if (!strcmp(argv[i], "--pid-fd") && i + 1 < argc) {
			pid_fd = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--init-cwd") && i + 1 < argc) {
			init_cwd = argv[++i];
		} else if (!strcmp(argv[i], "--private-tmp") && i + 1 < argc) {
			private_tmp(argc, argv, i);
		} else if (!strcmp(argv[i], "--mounted")) { /* internal: re-exec'ed by private_tmp() */
			mounted = 1;
		} else if (!strcmp(argv[i], "--netns") && i + 1 < argc) {
			netns = argv[++i];
		} else if (!strcmp(argv[i], "--fd") && i + 1 < argc && nfds < MAX_FDS) {
			if (sscanf(argv[++i], "%d:%d", &src[nfds], &dst[nfds]) != 2 ||
			    dst[nfds] < 0 || dst[nfds] >= HIGH_FD)
				usage();
			if (dst[nfds] > max_dst)
				max_dst = dst[nfds];
			nfds++;
		} else {
			usage();
		}
	}
	if (pid_fd < 0 || i >= argc)
		usage();
	argv += i;

	/* Park everything high first so that a SRC equal to another DST is not clobbered. */
	pid_fd = fcntl(pid_fd, F_DUPFD_CLOEXEC, HIGH_FD);
	if (pid_fd < 0)
		die("dup pid fd");
	for (i = 0; i < nfds; i++) {
		src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, HIGH_FD);
		if (src[i] < 0)
			die("dup fd");
	}
	for (i = 0; i < nfds; i++)
		if (dup2(src[i], dst[i]) < 0)
			die("dup2");
	/*
	 * Everything above the targets goes, whatever its number: the parked copies, the
	 * originals of SRC and of the pid fd (the caller passed them inheritable), and anything
	 * else the caller leaked. Only the pid fd's parked copy (close-on-exec) stays until the
	 * init's pid is written.
	 */
	close_all_from(max_dst + 1, pid_fd);

	if (netns) {
		int nsfd = open(netns, O_RDONLY | O_CLOEXEC);

		if (nsfd < 0 || setns(nsfd, CLONE_NEWNET) < 0)
			die(netns);
		close(nsfd);
	}
	/*
	 * The host's named network namespaces (nsfs mounts under /run/netns) would be pinned by
	 * our copies of them, and a restore would need every one of them still there.
	 */
	if (mounted)
		umount2("/run/netns", MNT_DETACH); /* EINVAL/ENOENT when there is none: fine */

	/* Block before the fork so that no signal or SIGCHLD is lost before sigwaitinfo. */
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	for (i = 0; i < (int)(sizeof(fwd_sigs) / sizeof(fwd_sigs[0])); i++)
		sigaddset(&set, fwd_sigs[i]);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		die("sigprocmask");

	/*
	 * The init starts the rank only once its pid reached the caller (`go`): if we die or the
	 * caller stopped listening before that, the init sees EOF and exits, so no rank ever runs
	 * that the caller does not know of.
	 */
	if (pipe2(go, O_CLOEXEC) < 0)
		die("pipe");
	if (unshare(CLONE_NEWPID) < 0)
		die("unshare(CLONE_NEWPID)");
	init = fork();
	if (init < 0)
		die("fork init");
	if (init == 0) {
		char c;

		close(pid_fd);
		close(go[1]);
		if (read(go[0], &c, 1) != 1)
			_exit(127); /* the caller never learnt our pid: run nothing */
		close(go[0]);
		/*
		 * A procfs of this PID namespace, in our private mount namespace: the host's /proc
		 * names host pids, so /proc/<getpid()> would be some other process. The CUDA driver
		 * looks itself up that way and fails cuInit with error 304 without this (seen on the
		 * H200 machine; `unshare --pid --fork` fails the same, `--mount-proc` works).
		 */
		if (mounted && mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
			die("mount /proc");
		_exit(run_init(argv, init_cwd, &set));
	}
	close(go[0]);
	snprintf(buf, sizeof(buf), "%d\n", (int)init);
	if (write(pid_fd, buf, strlen(buf)) != (ssize_t)strlen(buf)) {
		close(go[1]); /* the init exits without running anything; it is still our child */
		waitpid(init, NULL, 0);
		die("write pid");
	}
	close(pid_fd);
	if (write(go[1], "g", 1) != 1)
		die("start the init");
	return 0;
}
