# frozen_string_literal: true

require "open3"
require "fileutils"
require "rbconfig"

module NeverBlockBench
  # Git worktrees of earlier revisions of this repository, for a bench's
  # "before" rows: each in the bench's scratch directory, with this
  # checkout's vendor/ linked in, removed by {#cleanup}. For a Bench.
  module Worktrees
    REPO = File.expand_path("../..", __dir__)

    # @return [String] a worktree of `revision`
    def checkout(revision)
      dir = File.join(scratch, "rev-#{revision}")
      git(REPO, "worktree", "add", "--detach", dir, revision)
      FileUtils.ln_s(File.join(REPO, "vendor"), File.join(dir, "vendor"))
      (@worktrees ||= []) << dir
      dir
    end

    # The environment that runs `dir`'s code in place of this checkout's,
    # under this process's bundle: `dir`'s lib/ and its own C extension
    # (built now if needed) come first on the load path (RUBYLIB precedes
    # the bundle's paths).
    # @return [Hash{String => String}]
    def revision_env(dir)
      { "RUBYLIB" => [File.join(dir, "lib"), extension(dir)].join(File::PATH_SEPARATOR) }
    end

    # @return [String] the directory of `dir`'s built C extension, built now
    #   if needed (by `dir`'s bin/lib/compile_ext.rb, for the Ruby running this)
    # @raise [RuntimeError] when the build fails
    def extension(dir)
      output, status = Open3.capture2e(RbConfig.ruby, File.join(dir, "bin/lib/compile_ext.rb"), chdir: dir)
      raise "building #{dir}'s extension failed:\n#{output}" unless status.success?

      output.lines.last.strip
    end

    # Whether this checkout has uncommitted changes to tracked files.
    def dirty? = !git(REPO, "status", "--porcelain", "--untracked-files=no").empty?

    # @return [String] git's output
    # @raise [RuntimeError] when git fails
    def git(dir, *args)
      output, status = Open3.capture2e("git", "-C", dir, *args)
      raise "git #{args.join(' ')} failed: #{output}" unless status.success?

      output.strip
    end

    def cleanup
      @worktrees&.each { |dir| git(REPO, "worktree", "remove", "--force", dir) }
      super
    end
  end
end
