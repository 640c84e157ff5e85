# frozen_string_literal: true

module NeverBlock
  class Task
    # The task tree: a task spawned while another task runs is that task's
    # child, so nothing a task started outlives it by accident.
    #
    # - A task that ends by an exception, or is cancelled, first cancels its
    #   children still running (their `ensure` clauses run; a query one waits
    #   on is cancelled on the database server by the pools' recovery), and
    #   waits for them, at most {NeverBlock.cancel_timeout} seconds: a child
    #   that outlasts that (it swallowed the cancel, or is stuck in a C call)
    #   is logged and detached, not waited on forever.
    # - A task that returns hands the children still running to its own
    #   parent (to the loop, for a root): they go on, and whoever cancels an
    #   ancestor still reaches them.
    # - A timeout that fires (NeverBlock.timeout, Timeout.timeout,
    #   the server's request_timeout) cancels what was spawned inside its
    #   block, the same way (Scheduler#timeout_after).
    # - A finished child leaves its parent at once: a long-lived task that
    #   spawns a million short ones holds only those still running.
    # - `NeverBlock.spawn(detached: true)` starts a root: a task of no
    #   parent, for work that must outlive the code that started it.
    # - A root the app starts (detached, by `Fiber.schedule`, or a child
    #   whose root parent returned) joins the {#scope} of the tree that
    #   started it: what bounds its life where no parent does. A server
    #   gives its connection tasks one, so what its requests leave running
    #   ends with the server ({Server::AppTasks}), not with the request.
    #   A detached one records where the app spawned it ({#spawned_at}).
    #
    # Who calls it: Scheduler#spawn and #adopt (#adopt_child, #root_from,
    # #internal!), FiberHooks#fiber (#root_from), the task itself as it
    # ends (Task#execute), Scheduler#timeout_after and the server's request
    # loop (#reap with a mark). Loop's thread only.
    #
    # A child's `seq` numbers it among its parent's children; a mark taken
    # from #spawned before a block and handed to #reap after it names what
    # the block started. A child handed up to a grandparent takes its
    # finished parent's number there, so a mark still names it exactly when
    # its parent was started inside the block.
    module Tree
      # The fiber-local key holding the task a fiber runs.
      CURRENT = :__neverblock_task__

      # @return [Task, nil] the task this one is a child of; nil for a root.
      attr_reader :parent

      # @return [Thread::Backtrace::Location, nil] where the app spawned this
      #   task, if it spawned it detached: the first frame outside NeverBlock
      #   ({SpawnSite}). nil for the others ({#inspect} shows where their
      #   block is).
      attr_reader :spawned_at

      # @api private
      # @return [Object, nil] what bounds the life of this root: set by
      #   NeverBlock on the roots it starts for the app (a server's
      #   connection tasks get their server's {Server::AppTasks}), and
      #   taken by every root the app starts under them (#root_from); nil
      #   for none.
      attr_accessor :scope

      # @api private
      # @return [Boolean] true for a task NeverBlock spawned for itself (a
      #   server's accept loop, a log flush): no scope, no spawn site.
      def internal?
        @internal == true
      end

      # @api private
      # Marks this new, pending root as NeverBlock's own (#internal?).
      # @return [void]
      def internal!
        @internal = true
      end

      # @api private
      # Makes this new, pending root one the app started from `spawner`
      # (the task running the spawn; nil outside any): it joins the scope of
      # spawner's tree and, with `site` (a detached spawn), records where it
      # was spawned ({SpawnSite}).
      # @return [void]
      def root_from(spawner, site)
        @spawned_at = SpawnSite.find if site
        @scope = spawner.tree_scope if spawner
      end

      # @api private
      # @return [Object, nil] the {#scope} of this task's tree (its root's).
      def tree_scope
        root = self
        while (parent = root.parent)
          root = parent
        end
        root.scope
      end

      # @api private
      # @return [Integer] its number among its parent's children.
      attr_accessor :seq

      # @return [Array<Task>] the children still pending or running.
      def children
        @children ? @children.keys : []
      end

      # @api private
      # @return [Integer] how many children this task has started so far: a
      #   mark for {#reap}.
      def spawned
        @spawned || 0
      end

      # @api private
      # Makes `child` (a new, pending task) a child of this task: the task
      # running in the spawning fiber, which runs only this loop's tasks and
      # user code only while its task runs, so no more checks are needed.
      # @return [Task] the child.
      def adopt_child(child)
        take_child(child, @spawned = (@spawned || 0) + 1)
        child
      end

      # @api private
      # Cancels the children numbered above `mark` (each once; with mark 0,
      # all of them) and waits for them to end, at most
      # {NeverBlock.cancel_timeout} seconds; a child still running then is
      # logged and detached. Called from this task's own fiber.
      # @param mark [Integer] from {#spawned}.
      # @param why [String] for the Cancelled message: what ended the scope.
      # @return [void]
      def reap(mark = 0, why = "ended")
        return unless reapable?(mark)

        deadline = Clock.now + NeverBlock.cancel_timeout
        while (targets = children_since(mark)) && !targets.empty?
          # Pending ones first: a pool's fiber freed by a running child's
          # end would otherwise start the next queued one.
          targets.each { |child| child.cancel_by_parent(self, why) if child.status == :pending }
          targets.each { |child| child.cancel_by_parent(self, why) }
          left = deadline - Clock.now
          break if left <= 0 || !wait_for_children(targets, left)
        end
        abandon(children_since(mark)) if reapable?(mark)
      end

      # @api private
      # Whether any child numbered above `mark` is still running.
      def reapable?(mark)
        children = @children
        return false if children.nil? || children.empty?
        return true if mark.zero?

        children.each_key { |child| return true if child.seq > mark }
        false
      end

      protected

      attr_writer :parent

      # Becomes the child numbered `seq` of `parent`.
      def attach(parent, seq)
        @parent = parent
        @seq = seq
      end

      # Cancels this task for its parent, once: a child already cancelled
      # is left to finish its cleanup (a second Cancelled would cut its
      # `ensure` short).
      def cancel_by_parent(parent, why)
        return if @cancel_requested || !alive?

        cancel_with(Cancelled.new("task was cancelled: its parent #{parent.inspect} #{why}"))
      end

      # A child ended: it leaves the tree, and a reaping parent looks again.
      def child_ended(child)
        @children&.delete(child)
        @scheduler.wake(@reaper) if @reaper
      end

      # Makes `child` this task's, numbered `seq`: a new one (#adopt_child),
      # or one whose parent returned, behind that parent's number.
      def take_child(child, seq)
        child.attach(self, seq)
        (@children ||= {}.compare_by_identity)[child] = true
      end

      private

      def children_since(mark)
        children = @children or return nil
        return children.keys if mark.zero?

        children.each_key.select { |child| child.seq > mark }
      end

      # @return [Boolean] false when time ran out first.
      def wait_for_children(targets, seconds)
        @reaper = Fiber.current
        @scheduler.wait_until(seconds) { targets.none?(&:alive?) }
      ensure
        @reaper = nil
      end

      # Children that outlived the wait: logged, then roots of their own,
      # in the scope of this tree.
      def abandon(children)
        return if children.nil? || children.empty?

        NeverBlock.logger.warn("NeverBlock") do
          "#{inspect} ended, but #{children.size} of its cancelled children still run after " \
            "#{NeverBlock.cancel_timeout} s (they rescue NeverBlock::Cancelled, or wait in a C call); " \
            "detached: #{children.map(&:inspect).join(', ')}"
        end
        scope = tree_scope
        children.each do |child|
          @children.delete(child)
          child.parent = nil
          child.scope = scope
        end
      end

      # As the task ends: the children go (cancelled) or go up (returned).
      def leave_tree(status)
        if status != :completed && @children && !@children.empty?
          @ending = true
          reap(0, status == :cancelled ? "was cancelled" : "failed")
        end
        hand_up_children
      end

      def hand_up_children
        children = @children
        return if children.nil? || children.empty?

        parent = @parent
        seq = @seq
        children.each_key do |child|
          if parent
            parent.take_child(child, seq)
          else # roots in this root's scope
            child.parent = nil
            child.scope = @scope
          end
        end
        @children = nil
      end

      def leave_parent
        parent = @parent
        @parent = nil
        parent.child_ended(self)
      end
    end
  end
end
