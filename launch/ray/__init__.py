"""pdserve on a Ray cluster (`pdserve serve --ray`): cluster.py (the driver: serve and
scale), members.py (the Controller actor: places, scales and stops the members),
member.py (the Member actor: one pdserve process), keys.py (the CURVE keys the controller
hands out), model_copy.py (a model shipped to the machines). It imports the processes'
packages and launch/cluster/ (the plan); only the entry points import it. Importing this
package imports no ray: its modules do, and only the --ray path imports them."""
